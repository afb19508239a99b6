"""What profiling/gpu_check.py reports: the key numbers it reads from each stage's files
(junit XML, bench JSON) into summary.json, and the table it prints last.

The table is the end of the device call's output tail, so it says everything a reader
needs to act on: each stage's status and time (the must-pass core marked `*`, and a line
saying which of its stages passed), every failed test with the first line of its error,
per-test durations, the build's register counts, the bench numbers, and, when something
failed, was cut or was skipped for want of budget, the exact command that reruns just
that, with its budget.
"""

from __future__ import annotations

import json
import textwrap
import xml.etree.ElementTree as ET

# Stage statuses: ok, failed, timeout (hit its own limit), cut (stopped because the budget ran
# out: not a failure, but rerun it), skipped (not started; "rerun" set when for want of budget).
BAD = ("failed", "timeout")


def _first_line(text: str | None) -> str:
    for line in (text or "").splitlines():
        if line.strip():
            return line.strip()
    return ""


def junit_report(path: str) -> dict | None:
    """Counts, the durations of the tests that ran (slowest first), each failure's first error
    line and location, and skip reasons from a junit XML (None if unreadable)."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failed, failures, skips, durations = [], {}, {}, []
    for case in root.iter("testcase"):
        cls = case.get("classname", "").rpartition(".")[2]
        name = f"{cls}::{case.get('name')}" if cls else str(case.get("name"))
        seconds = round(float(case.get("time") or 0.0), 2)
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        if bad is not None:
            counts["failed" if bad.tag == "failure" else "errors"] += 1
            failed.append(name)
            # the error's first line, and where it was raised (the last line: "path:line: Error")
            where = _first_line("\n".join(reversed((bad.text or "").splitlines())))
            failures[name] = _first_line(bad.get("message")) + (f" ({where})" if where else "")
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
            skips[name] = _first_line(case.find("skipped").get("message"))
            continue  # no duration: it did not run
        else:
            counts["passed"] += 1
        durations.append([name, seconds])
    durations.sort(key=lambda item: -item[1])
    return {**counts, "failed_tests": failed, "failures": failures, "skip_reasons": skips, "durations": durations}


def _read_json(path: str) -> dict | None:
    """A bench's JSON, or None when it is missing or unreadable (a stage that did not get that far)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _r(value):
    return round(value, 3) if isinstance(value, float) else value


def bench_points(path: str) -> dict | None:
    """tokens/s and ms/step per point of a bench JSON (written after every point, so partial runs count)."""
    data = _read_json(path)
    if data is None:
        return None
    points = [
        {"k": p.get("k"), "batch": p.get("batch"), "bucket": p.get("bucket"),
         "tokens_per_s": round(p["tokens_per_s"], 1), "ms_per_decode_step": round(p["ms_per_decode_step"], 3)}
        for p in data.get("points", []) if "tokens_per_s" in p and "ms_per_decode_step" in p
    ]
    config = data.get("engine_config", {})
    return {"points": points, "attention_backend": config.get("attention_backend"), "compile": config.get("compile"),
            "capture_seconds": config.get("capture_seconds"), "model": data.get("model_name")}


def side_bench_points(path: str) -> dict | None:
    """The key numbers of bench_spec / bench_tp JSON, for summary.json."""
    data = _read_json(path)
    if data is None:
        return None
    keep = ("set", "batch", "tp", "plain_tokens_per_s", "spec_tokens_per_s", "speedup", "accepted_per_verify",
            "same_tokens", "decode_tokens_per_s", "collective_share")
    points = [{k: _r(v) for k, v in p.items() if k in keep} for p in data.get("points", [])]
    return {"points": points, "speedup": data.get("speedup"), "same_tokens": data.get("same_tokens")}


def serve_points(path: str) -> dict | None:
    """The key numbers of a bench_serve JSON, for summary.json."""
    data = _read_json(path)
    if data is None:
        return None
    points = [{"clients": p["clients"], "served_tokens_per_s": _r(p["served"]["tokens_per_s"]),
               "in_process_tokens_per_s": _r((p.get("in_process") or {}).get("tokens_per_s")),
               "ratio": _r(p.get("served_over_in_process")), "ttft_p50_s": _r(p["served"]["ttft_p50_s"]),
               "itl_p99_s": _r(p["served"]["itl_p99_s"]),
               "itl_p99_over_window_mean": _r(p.get("itl_p99_over_window_mean"))}
              for p in data.get("points", [])]
    return {"points": points, "goals": {k: _r(v) for k, v in data.get("goals", {}).items()}, "model": data.get("model")}


def structured_points(path: str) -> dict | None:
    """The key numbers of a bench_structured JSON, for summary.json."""
    data = _read_json(path)
    if data is None:
        return None
    points = [{"batch": int(batch), "unconstrained_tokens_per_s": _r(p["unconstrained"]["tokens_per_s"]),
               "constrained_tokens_per_s": _r(p["constrained"]["tokens_per_s"]), "ratio": _r(p["ratio"])}
              for batch, p in data.get("points", {}).items()]
    return {"points": points, "compile": {k: _r(v) for k, v in data.get("compile", {}).items()},
            "admission_added_s": _r((data.get("admission") or {}).get("added_s")), "goals": data.get("goals")}


def moe_points(path: str) -> dict | None:
    """The key numbers of a bench_moe JSON, for summary.json."""
    data = _read_json(path)
    if data is None:
        return None
    points = []
    for p in data.get("points", []):
        point = {"batch": p["batch"], "transformers_tokens_per_s": _r((p.get("transformers") or {}).get(
            "decode_tokens_per_s"))}
        for impl, side in (p.get("graphdecode") or {}).items():
            point[f"{impl}_tokens_per_s"] = _r(side.get("decode_tokens_per_s"))
            point[f"{impl}_moe_share"] = _r((side.get("moe") or {}).get("share"))
        point.update({f"{impl}_ratio": _r(r) for impl, r in (p.get("ratio") or {}).items()})
        points.append(point)
    return {"points": points, "family": data.get("family"), "preset": data.get("preset")}


def quant_points(path: str) -> dict | None:
    """The key numbers of a bench_quant_gpu JSON, for summary.json: per format its kernel, decode tokens/s per
    batch and the ratio to bf16's."""
    data = _read_json(path)
    if data is None:
        return None
    base = data.get("formats", {}).get("bf16")
    points = []
    for name, entry in data.get("formats", {}).items():
        for i, p in enumerate(entry["decode"]):
            ratio = p["decode_tokens_per_s"] / base["decode"][i]["decode_tokens_per_s"] if base else None
            points.append({"format": name, "kernel": entry["kernel"], "batch": p["batch"],
                           "tokens_per_s": _r(p["decode_tokens_per_s"]), "vs_bf16": _r(ratio)})
    return {"points": points}


def stage_passed(name: str, st: dict) -> tuple[bool, str]:
    """Whether a stage passed, and if not, why not in a few words. A pytest stage passes only if
    at least one test ran and none failed: one whose tests all skipped proved nothing."""
    status = st["status"]
    if status != "ok":
        detail = f" rc={st['rc']}" if status == "failed" and st.get("rc") else ""
        return False, status + detail + (f": {st['reason']}" if st.get("reason") else "")
    if not name.startswith("pytest_"):
        return True, "ok"
    tests = st.get("tests")
    if not tests:
        return False, "ok but no junit XML"
    if tests["failed"] or tests["errors"]:
        return False, f"{tests['failed']} failed, {tests['errors']} errors"
    if not tests["passed"]:
        return False, f"no test ran ({tests['skipped']} skipped)"
    return True, "ok"


def must_pass(summary: dict, core: tuple[str, ...], needs: dict) -> dict:
    """summary.json's `must_pass`: the core's stages, their summed need, which passed, why the
    others did not, and `ok` when every one passed."""
    passed, not_passed = [], {}
    for name in core:
        ok, why = stage_passed(name, summary["stages"][name])
        if ok:
            passed.append(name)
        else:
            not_passed[name] = why
    return {"stages": list(core), "need_s": sum(needs[name] for name in core), "passed": passed,
            "not_passed": not_passed, "ok": not not_passed}


def rerun_stages(summary: dict) -> list[str]:
    """Stages worth another call: failed, timed out, cut, or skipped for want of budget."""
    return [name for name, st in summary["stages"].items()
            if st["status"] in (*BAD, "cut") or (st["status"] == "skipped" and st.get("rerun"))]


def rerun_command(summary: dict, needs: dict) -> str | None:
    """The exact command that reruns what is worth rerunning, with a budget that holds it."""
    stages = rerun_stages(summary)
    if not stages:
        return None
    budget = needs["env"] + sum(needs[name] for name in stages) + 10
    dry = " --dry-run" if summary["dry_run"] else ""
    return f"bash profiling/gpu_check.sh{dry} --only {','.join(stages)} --budget {budget:.0f}"


def _pack(items: list[str], indent: int, width: int = 150) -> list[str]:
    return textwrap.wrap("  ".join(items), width=width, initial_indent=" " * indent, subsequent_indent=" " * indent)


def _bench_line(p: dict) -> str:
    if "k" in p:  # the bucket sweeps
        return f"k={p['k']} batch={p['batch']}: {p['tokens_per_s']:.0f} tok/s, {p['ms_per_decode_step']:.3f} ms/step"
    if "set" in p:  # speculative vs plain
        return (f"{p['set']} batch={p['batch']}: {p['plain_tokens_per_s']:.0f} -> {p['spec_tokens_per_s']:.0f} "
                f"tok/s ({p['speedup']:.2f}x), {p['accepted_per_verify']:.2f} accepted/verify, "
                f"same tokens {p['same_tokens']}")
    if "tp" in p:
        return (f"TP={p['tp']} batch={p['batch']}: {p['decode_tokens_per_s']:.0f} tok/s, "
                f"collectives {100 * p['collective_share']:.0f}%")
    if "grouped_tokens_per_s" in p or "dense_tokens_per_s" in p:
        impls = [k[: -len("_tokens_per_s")] for k in p
                 if k.endswith("_tokens_per_s") and k != "transformers_tokens_per_s"]
        sides = ", ".join(f"{i} {p[i + '_tokens_per_s']:.0f} tok/s ({p.get(i + '_ratio')}x, MoE "
                          f"{p.get(i + '_moe_share')})" for i in impls)
        return f"moe batch={p['batch']}: {sides}; transformers {p['transformers_tokens_per_s']}"
    if "format" in p:  # quantized weights / FP8 KV beside bf16
        return (f"{p['format']} ({p['kernel']}) batch={p['batch']}: {p['tokens_per_s']:.0f} tok/s "
                f"({p['vs_bf16']}x bf16)")
    if "constrained_tokens_per_s" in p:
        return (f"structured batch={p['batch']}: {p['unconstrained_tokens_per_s']:.0f} -> "
                f"{p['constrained_tokens_per_s']:.0f} tok/s constrained ({p['ratio']}x)")
    return (f"{p['clients']} clients: served {p['served_tokens_per_s']:.0f} / in-process "
            f"{p['in_process_tokens_per_s']:.0f} tok/s = {p['ratio']}, "
            f"p99 ITL / window {p['itl_p99_over_window_mean']}")


def _notes(name: str, st: dict) -> str:
    notes = []
    if st.get("reason"):
        notes.append(st["reason"])
    env = st.get("env")
    if env:
        notes.append(f"python {env.get('python')} torch {env.get('torch')} cuda {env.get('cuda')} "
                     f"{env.get('gpu', 'no GPU')}")
    if st.get("flashinfer"):
        notes.append(f"flashinfer {st['flashinfer']}")
    kernels = st.get("kernels")
    if kernels:
        notes.append(", ".join(f"{k['kernel']} {k['registers']} regs"
                               + (f" {k['spill_stores']}B spilled" if k["spill_stores"] else "")
                               for k in kernels) + f" ({kernels[0]['arch']})")
    if st.get("optional_missing"):
        notes.append(f"without {', '.join(st['optional_missing'])}")
    check = st.get("check")
    if check:
        notes.append(f"kit check (info): {check['status']}, {check['passed']} PASS {len(check['failed'])} FAIL")
    tests = st.get("tests")
    if tests:
        notes.append(f"{tests['passed']} passed {tests['failed']} failed {tests['errors']} errors "
                     f"{tests['skipped']} skipped")
    elif name.startswith("pytest_") and st["status"] not in ("pending", "skipped"):
        notes.append("no junit XML")
    bench = st.get("bench")
    if bench is not None:
        notes.append(f"{len(bench['points'])} points"
                     + (f", attention {bench['attention_backend']}" if bench.get("attention_backend") else ""))
    elif name.startswith("bench") and st["status"] not in ("pending", "skipped"):
        notes.append("no bench JSON")
    return "; ".join(notes)


def table(summary: dict, out: str, needs: dict, left_s: float) -> str:
    s = summary
    lines = ["=" * 78,
             f"gpu_check summary{' (DRY RUN)' if s['dry_run'] else ''}: {s['elapsed_s']:.0f}s of a "
             f"{s['budget_s']:.0f}s budget{', TERMINATED by ' + s['terminated'] if s['terminated'] else ''}",
             f"{'stage (* must pass)':<20} {'status':<12} {'secs':>5} {'need':>5}  notes"]
    core = set((s.get("must_pass") or {}).get("stages", ()))
    for name, st in s["stages"].items():
        status = st["status"] + (f" rc={st['rc']}" if st["status"] == "failed" and st.get("rc") else "")
        label = name + ("*" if name in core else "")
        lines.append(f"{label:<20} {status:<12} {st.get('seconds', 0):>5.0f} {st.get('need_s', 0):>5.0f}  "
                     f"{_notes(name, st)}"[:170])
        tests = st.get("tests") or {}
        for test in tests.get("failed_tests", []):
            lines.append(f"{'':<22}FAILED {test}: {tests['failures'].get(test, '')}"[:230])
        reasons = sorted(set(tests.get("skip_reasons", {}).values()))
        for reason in reasons[:3]:
            lines.append(f"{'':<22}skip: {reason}"[:200])
        if tests.get("durations"):
            lines.extend(_pack([f"{t.split('::')[-1]} {sec:.1f}s" for t, sec in tests["durations"]], 22))
        for p in (st.get("bench") or {}).get("points", []):
            lines.append(f"{'':<22}{_bench_line(p)}")
    core_result = s.get("must_pass")
    if core_result:
        passed = core_result["passed"]
        lines.append(f"must-pass core (*, need ~{core_result['need_s']:.0f}s): "
                     + ("ALL PASSED" if core_result["ok"] else
                        f"{len(passed)}/{len(core_result['stages'])} passed ({', '.join(passed) or 'none'})"))
        for name, why in core_result["not_passed"].items():
            lines.append(f"{'':<22}not passed: {name}: {why}"[:200])
    bad = [n for n, st in s["stages"].items() if st["status"] in BAD]
    cut = [n for n, st in s["stages"].items() if st["status"] == "cut"]
    lines.append(f"result: {'OK' if not bad else 'FAILED: ' + ', '.join(bad)}"
                 + (f"; cut by the budget: {', '.join(cut)}" if cut else "") + f"; OUT={out}")
    lines.append("files: " + ", ".join(s.get("out_files", [])))
    command = rerun_command(s, needs)
    if command:
        lines.append(f"rerun ({max(left_s, 0):.0f}s of this run's budget were left): {command}")
    lines.append("=" * 78)
    return "\n".join(lines)
