"""A CPU model's weights collapsed onto 2 MiB pages (models/huge_pages.py, EngineConfig.cpu_huge_pages)."""

from __future__ import annotations

import ctypes
import errno
import sys

import pytest
import torch

from graphdecode.models import huge_pages
from graphdecode.models.huge_pages import HUGE_PAGE, HugePages, collapse_pages, inner_pages, merged_ranges

MiB = 1 << 20


def _anon_huge_bytes(start: int, stop: int) -> int:
    """AnonHugePages of the mappings that overlap [start, stop) (/proc/self/smaps): a tensor's range may span
    several (the kernel splits a mapping where flags or neighbours differ)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                low, high = (int(x, 16) for x in head.split("-"))
                inside = low < stop and start < high
            elif inside and head == "AnonHugePages:":
                total += int(line.split()[1]) * 1024
    return total


def test_ranges_merge_across_malloc_headers_and_only_whole_pages_inside_are_collapsed():
    class Fake:
        def __init__(self, ptr, size):
            self.ptr, self.size = ptr, size

        def untyped_storage(self):
            return self

        def data_ptr(self):
            return self.ptr

        def nbytes(self):
            return self.size

        def numel(self):
            return self.size

    base = 1000 * HUGE_PAGE
    # two weights 4 KiB apart (one range), a view of the first (its storage again), one far away, one empty
    tensors = [Fake(base + 16, 3 * MiB), Fake(base + 16, 3 * MiB), Fake(base + 3 * MiB + 4096, 5 * MiB),
               Fake(base + 100 * MiB, MiB), Fake(base + 200 * MiB, 0)]
    ranges = merged_ranges(tensors)
    assert ranges == [(base + 16, base + 8 * MiB + 4096), (base + 100 * MiB, base + 101 * MiB)]
    # the first page starts 16 bytes before the weights: not theirs alone; the 1 MiB range holds no whole page
    assert inner_pages(ranges) == [base + HUGE_PAGE, base + 2 * HUGE_PAGE, base + 3 * HUGE_PAGE]


def test_pages_the_kernel_refuses_are_skipped_and_a_kernel_without_collapse_ends_the_walk():
    calls = []

    def madvise(refusals):
        def call(address, length, advice):
            calls.append((address, length, advice))
            code = refusals.get(address, 0)
            ctypes.set_errno(code)
            return -1 if code else 0
        return call

    pages = [HUGE_PAGE * i for i in range(1, 5)]
    assert collapse_pages(pages, madvise({2 * HUGE_PAGE: errno.EAGAIN, 3 * HUGE_PAGE: errno.ENOMEM})) == 2 * HUGE_PAGE
    assert calls == [(p, HUGE_PAGE, huge_pages.MADV_COLLAPSE) for p in pages]
    calls.clear()
    assert collapse_pages(pages, madvise({HUGE_PAGE: errno.EINVAL})) == 0
    assert len(calls) == 1  # no MADV_COLLAPSE here: no call for every other page


def test_the_tensors_of_a_cpu_model_include_its_panels_and_no_module_is_missed(text_model):
    from graphdecode.kernels.cpu import cpu_kernels
    from graphdecode.models.cpu_linear import CpuWeight
    from graphdecode.models.loader import load_model
    from graphdecode.models.model_config import load_model_config

    path = text_model
    model = load_model(path, load_model_config(path), torch.float32, torch.device("cpu"), 64)
    assert not hasattr(model, "huge_pages")  # off unless asked
    found = {t.untyped_storage().data_ptr() for t in huge_pages.model_tensors(model)}
    weights = [m.packed for m in model.modules() if isinstance(getattr(m, "packed", None), CpuWeight)]
    weights += [model.packed_head] if model.packed_head is not None else []
    panels = [w.panels for w in weights if hasattr(w, "panels")]
    linears = 4 * load_model_config(path).num_layers + 1  # qkv, o, gate_up, down; the head
    assert len(panels) == len(weights) == linears if cpu_kernels() is not None else not panels
    assert all(p.untyped_storage().data_ptr() in found for p in panels)
    assert all(p.untyped_storage().data_ptr() in found for p in model.parameters() if p.numel())
    on = load_model(path, load_model_config(path), torch.float32, torch.device("cpu"), 64, huge_pages=True)
    assert isinstance(on.huge_pages, HugePages)
    # the pages are the whole 2 MiB pages inside its tensors' merged ranges (a tiny model's tensors, 1 MiB at
    # most, make one only where the allocator put several side by side), and no more than those are collapsed
    assert on.huge_pages.pages == huge_pages.inner_pages(huge_pages.merged_ranges(huge_pages.model_tensors(on)))
    assert on.huge_pages.wait() <= len(on.huge_pages.pages) * HUGE_PAGE


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_COLLAPSE is Linux's")
def test_a_weight_is_collapsed_in_place_with_its_values():
    layer = torch.nn.Linear(1024, 4096, bias=False)  # 16 MiB of fp32
    torch.nn.init.normal_(layer.weight)
    before = layer.weight.detach().clone()
    address = layer.weight.data_ptr()
    collapse = HugePages(layer)
    done = collapse.wait()
    if done == 0 and huge_pages.libc_madvise()(collapse.pages[0], HUGE_PAGE, huge_pages.MADV_COLLAPSE) != 0 \
            and ctypes.get_errno() == errno.EINVAL:
        pytest.skip("this kernel has no MADV_COLLAPSE (Linux < 6.1): the weights keep their pages")
    assert len(collapse.pages) >= 7 and done == len(collapse.pages) * HUGE_PAGE
    assert layer.weight.data_ptr() == address and torch.equal(layer.weight, before)
    assert _anon_huge_bytes(address, address + 16 * MiB) >= done


def test_the_engine_option_and_its_flag(text_model, llm_options):
    from graphdecode.cli import main
    from graphdecode.config import EngineConfig

    with pytest.raises(ValueError, match="cpu_huge_pages"):
        EngineConfig(model=text_model, cpu_huge_pages="yes")
    seen, Built = llm_options
    for flag in ([], ["--no-cpu-huge-pages"]):
        with pytest.raises(Built):
            main(["generate", "--model", text_model, *flag, "Hi"])
    assert [options.get("cpu_huge_pages", "default") for options in seen] == ["default", False]

