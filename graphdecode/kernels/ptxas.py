"""What ptxas says about csrc's kernels, and whether their launches fit an SM.

`nvcc -Xptxas -v` (`kernel_build.build_with_report`) makes ptxas print, for each kernel
and each real architecture it assembles (`sm_90`; embedded PTX is not assembled), lines
such as

    ptxas info    : Compiling entry function '_ZN..19advance_rows_kernelE..' for 'sm_90'
    ptxas info    : Function properties for _ZN..19advance_rows_kernelE..
        0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
    ptxas info    : Used 47 registers, used 1 barriers, 4256 bytes smem

`parse` turns them into one `KernelUsage` per (kernel, architecture). `launch_problems`
checks each kernel against the block size csrc/advance_step.cu launches it with
(`LAUNCH_THREADS`): a block whose threads need more registers than one SM's register
file holds does not launch at all ("too many resources requested for launch"), which a
`__launch_bounds__` on the kernel rules out and this check confirms from the compiler's
own numbers, on any machine with nvcc.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

# The block sizes csrc/advance_step.cu launches its kernels with (kMaxRows, kIndexThreads).
LAUNCH_THREADS = {"advance_rows_kernel": 1024, "fill_indices_kernel": 128}
REGISTER_FILE = 65536  # 32-bit registers per SM, sm_50 to sm_120
REGISTER_UNIT = 256  # registers are allocated per warp in units of 256
MAX_REGISTERS_PER_THREAD = 255
WARP = 32

_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '([^']+)'")
_PROPERTIES = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


@dataclass(frozen=True)
class KernelUsage:
    kernel: str  # the kernel's own name (demangled enough: no namespace, no parameters)
    arch: str  # sm_90
    registers: int  # per thread
    spill_stores: int = 0  # bytes
    spill_loads: int = 0  # bytes
    stack_bytes: int = 0
    smem_bytes: int = 0  # static shared memory per block

    def as_dict(self) -> dict:
        return asdict(self)


def kernel_name(symbol: str) -> str:
    """The last identifier of an Itanium-mangled name (`_ZN<len><ns>..<len><name>E<params>` or
    `_Z<len><name><params>`); an extern "C" or unrecognised symbol as it is."""
    if not symbol.startswith("_Z"):
        return symbol
    i = 2
    nested = symbol[i:i + 1] == "N"
    i += nested
    name = symbol
    while i < len(symbol) and symbol[i].isdigit():
        j = i
        while j < len(symbol) and symbol[j].isdigit():
            j += 1
        length = int(symbol[i:j])
        name, i = symbol[j:j + length], j + length
        if not nested:
            break
    return name


def parse(text: str) -> list[KernelUsage]:
    """One KernelUsage per kernel and architecture, in the order ptxas compiled them."""
    usages: list[KernelUsage] = []
    current: dict | None = None

    def finish() -> None:
        if current is not None and "registers" in current:
            usages.append(KernelUsage(**current))

    for line in text.splitlines():
        entry = _ENTRY.search(line)
        if entry:
            finish()
            current = {"kernel": kernel_name(entry.group(1)), "arch": entry.group(2)}
            continue
        if current is None:
            continue
        properties = _PROPERTIES.search(line)
        if properties:
            current.update(stack_bytes=int(properties.group(1)), spill_stores=int(properties.group(2)),
                           spill_loads=int(properties.group(3)))
        used = _USED.search(line)
        if used:
            current["registers"] = int(used.group(1))
            smem = _SMEM.search(line)
            current["smem_bytes"] = int(smem.group(1)) if smem else 0
    finish()
    return usages


def block_registers(registers: int, threads: int) -> int:
    """Registers a block of `threads` threads takes from the SM's file (whole warps, whole units)."""
    per_warp = -(-registers * WARP // REGISTER_UNIT) * REGISTER_UNIT
    return per_warp * -(-threads // WARP)


def launch_problems(usages: list[KernelUsage], launch_threads: dict[str, int] = LAUNCH_THREADS) -> list[str]:
    """What would stop a launch: a launched kernel ptxas did not report, or a block whose registers
    exceed one SM's register file. Empty when every launch fits."""
    problems = []
    reported = {u.kernel for u in usages}
    for kernel in launch_threads:
        if kernel not in reported:
            problems.append(f"{kernel}: no ptxas report (not compiled, or nvcc ran without -Xptxas -v)")
    for usage in usages:
        threads = launch_threads.get(usage.kernel)
        if threads is None:
            continue
        need = block_registers(usage.registers, threads)
        if need > REGISTER_FILE or usage.registers > MAX_REGISTERS_PER_THREAD:
            problems.append(f"{usage.kernel} ({usage.arch}): {usage.registers} registers x {threads} threads "
                            f"need {need} registers, an SM has {REGISTER_FILE}: the launch would fail")
    return problems
