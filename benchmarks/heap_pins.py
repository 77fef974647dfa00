"""Which small blocks a first step leaves live in glibc's heap, who allocated them, and where (issue 34).

glibc can lower its heap (``brk``) only down to the highest block still in use, so a few small
long-lived blocks allocated while the first-batch check's temporaries fill the heap keep the whole
range the check grew mapped, and later steps fragment it (docs/performance.md, "LoRA memory: glibc's
heap modes" and "What pins the check's heap"). This tool runs one step of a ``transformer_step.py``
configuration under an ``LD_PRELOAD`` shim (compiled here with ``cc``) that keeps every live block of
at most 1 KiB allocated during the step, with its size, the dpopt phase it was allocated in and four
return addresses, and prints, for the blocks above the heap's end at the step's start:

* how many each (phase, owner) left, the owner read from the return addresses (``addr2line``
  against ``/proc/self/maps``): oneDNN's kernels, torch's Python bindings, CPython, numpy, ...;
* the highest blocks, with their offset above the step's start: the ones that pin the heap.

Linux with glibc, ``cc`` and ``addr2line`` only; a diagnostic, not a benchmark (no timing). Python
objects of at most 512 bytes live in CPython's own mmapped arenas and never show here.

Usage::

    python benchmarks/heap_pins.py --model gpt2-lora --config dp-sgd [--top 8]
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import os
import shutil
import subprocess
import sys
import tempfile

SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <execinfo.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#define MAXS 1024
#define TSIZE (1u << 22)
typedef struct { uintptr_t a; uint32_t size; int32_t phase; uintptr_t caller[4]; } ent;
static ent *tab;
static volatile int lock_;
static int phase_;
static __thread int inside;
static void *(*r_malloc)(size_t), (*r_free)(void *), *(*r_calloc)(size_t, size_t), *(*r_realloc)(void *, size_t);
static int (*r_pm)(void **, size_t, size_t);
static char boot[65536];
static size_t bootn;
static void init(void) {
  if (r_malloc) return;
  r_malloc = dlsym(RTLD_NEXT, "malloc"); r_free = dlsym(RTLD_NEXT, "free");
  r_calloc = dlsym(RTLD_NEXT, "calloc"); r_realloc = dlsym(RTLD_NEXT, "realloc");
  r_pm = dlsym(RTLD_NEXT, "posix_memalign");
  tab = mmap(0, sizeof(ent) * (size_t)TSIZE, PROT_READ | PROT_WRITE,
             MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
}
static inline uint32_t h(uintptr_t a) { return (uint32_t)((a >> 4) * 2654435761u) & (TSIZE - 1); }
static void lk(void) { while (__sync_lock_test_and_set(&lock_, 1)) ; }
static void ul(void) { __sync_lock_release(&lock_); }
static void put(void *p, size_t s) {
  if (!p || !phase_ || s > MAXS || inside) return;
  inside = 1;
  void *b[6] = {0}; int n = backtrace(b, 6);
  lk();
  uint32_t i = h((uintptr_t)p);
  while (tab[i].a) i = (i + 1) & (TSIZE - 1);
  tab[i].a = (uintptr_t)p; tab[i].size = s; tab[i].phase = phase_;
  for (int j = 0; j < 4; j++) tab[i].caller[j] = j + 2 < n ? (uintptr_t)b[j + 2] : 0;
  ul(); inside = 0;
}
static void del(void *p) {
  if (!p || !tab) return;
  lk();
  uint32_t i = h((uintptr_t)p);
  while (tab[i].a && tab[i].a != (uintptr_t)p) i = (i + 1) & (TSIZE - 1);
  if (tab[i].a) {
    uint32_t j = i;
    for (;;) {
      j = (j + 1) & (TSIZE - 1);
      if (!tab[j].a) break;
      uint32_t k = h(tab[j].a);
      if ((j > i && (k <= i || k > j)) || (j < i && (k <= i && k > j))) { tab[i] = tab[j]; i = j; }
    }
    tab[i].a = 0;
  }
  ul();
}
static int in_boot(void *p) { return (char *)p >= boot && (char *)p < boot + sizeof boot; }
static void *boot_alloc(size_t s) { void *p = boot + bootn; bootn += (s + 15) & ~(size_t)15; return p; }
void *malloc(size_t s) { if (!r_malloc) { if (!tab) return boot_alloc(s); init(); } void *p = r_malloc(s); put(p, s); return p; }
void *calloc(size_t n, size_t s) {
  if (!r_calloc) { if (!tab) { void *p = boot_alloc(n * s); memset(p, 0, n * s); return p; } init(); }
  void *p = r_calloc(n, s); put(p, n * s); return p;
}
void free(void *p) { if (in_boot(p)) return; if (!r_free) init(); del(p); r_free(p); }
void *realloc(void *p, size_t s) {
  if (in_boot(p)) { void *q = malloc(s); memcpy(q, p, s); return q; }
  if (!r_realloc) init();
  del(p); void *q = r_realloc(p, s); put(q, s); return q;
}
int posix_memalign(void **m, size_t al, size_t s) { if (!r_pm) init(); int r = r_pm(m, al, s); if (!r) put(*m, s); return r; }
void shim_phase(int p) { phase_ = p; }
long shim_dump(const char *path, uintptr_t lo) {
  FILE *f = fopen(path, "w"); long n = 0; int saved = phase_; phase_ = 0;
  for (uint32_t i = 0; i < TSIZE; i++)
    if (tab[i].a && tab[i].a >= lo) {
      fprintf(f, "%d %u %lu %lx %lx %lx %lx\n", tab[i].phase, tab[i].size, (unsigned long)(tab[i].a - lo),
              tab[i].caller[0], tab[i].caller[1], tab[i].caller[2], tab[i].caller[3]);
      n++;
    }
  fclose(f); phase_ = saved; return n;
}
"""

#: (substring of a resolved frame, owner), first match wins
OWNERS = [
    ("dnnl", "oneDNN kernels (primitive cache)"),
    ("Xbyak", "oneDNN kernels (primitive cache)"),
    ("PythonArgParser", "torch Python bindings"),
    ("FunctionSignature", "torch Python bindings"),
    ("initJITBindings", "torch Python bindings"),
    ("pybind11", "torch Python bindings"),
    ("_multiarray_umath", "numpy"),
    ("libpython", "CPython"),
    ("libtorch", "torch (other)"),
]


def owner(frames: list[str]) -> str:
    """The owner of a block from its resolved return addresses (:data:`OWNERS`), else ``"other"``."""
    text = " ".join(frames)
    return next((who for key, who in OWNERS if key in text), "other")


def resolve(addresses: set[int], maps_text: str) -> dict[int, str]:
    """``{address: "library:function"}`` for return addresses, via ``addr2line`` (one call per library).

    ``maps_text``: the process's ``/proc/self/maps``; an address outside every executable mapping
    keeps its hex form.
    """
    maps = []
    for line in maps_text.splitlines():
        p = line.split()
        if len(p) >= 6 and "x" in p[1]:
            lo, hi = (int(x, 16) for x in p[0].split("-"))
            maps.append((lo, hi, int(p[2], 16), p[5]))
    base = {}
    for lo, _, off, path in maps:
        base[path] = min(base.get(path, lo - off), lo - off)
    by_lib: dict[str, list[int]] = collections.defaultdict(list)
    out = {a: hex(a) for a in addresses}
    for a in addresses:
        for lo, hi, _, path in maps:
            if lo <= a < hi:
                by_lib[path].append(a)
                break
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    for path, addrs in by_lib.items():
        args = ["addr2line", "-C", "-f", "-e", path] + [hex(a - base[path]) for a in addrs]
        lines = subprocess.run(args, capture_output=True, text=True, env=env).stdout.splitlines()
        for a, fn in zip(addrs, lines[0::2]):
            out[a] = f"{os.path.basename(path)}:{fn[:80]}"
    return out


def child(model: str, config: str, shim_path: str, top: int) -> None:
    """Under the shim: one step of ``model|config`` with dpopt's phases marked; print the live blocks."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch
    from transformer_step import factory

    from dpopt.engine import capture as cap_mod
    from dpopt.engine import fast as fast_mod
    from dpopt.engine import hooks as hooks_mod

    shim = ctypes.CDLL(shim_path)
    shim.shim_dump.restype = ctypes.c_long
    shim.shim_dump.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    libc = ctypes.CDLL(None)
    libc.sbrk.restype = ctypes.c_void_p
    labels: list[str] = ["", "step"]
    current = [1]

    def mark(label: str):
        if label not in labels:
            labels.append(label)
        return labels.index(label)

    def wrap(owner_cls, name: str, label) -> None:
        orig = getattr(owner_cls, name, None)
        if orig is None:
            return

        def wrapped(*args, **kwargs):
            old = current[0]
            current[0] = mark(label(labels[old], args) if callable(label) else label)
            shim.shim_phase(current[0])
            try:
                return orig(*args, **kwargs)
            finally:
                current[0] = old
                shim.shim_phase(old)

        setattr(owner_cls, name, wrapped)

    wrap(fast_mod.PerSampleEngine, "_verify", "check")
    wrap(fast_mod.PerSampleEngine, "_verify_reference", "check: vmap reference")
    wrap(hooks_mod.HookCapture, "_verify", "check")
    wrap(cap_mod.Recorder, "_check_once", lambda _, a: f"check: {a[3]} rows")
    wrap(cap_mod.Recorder, "_loop_streamed", "check: single-example loop")
    wrap(cap_mod.Recorder, "_loop", "check: single-example loop")
    wrap(cap_mod.Recorder, "fill", lambda outer, _: f"{outer}, backward")
    torch.set_num_threads(1)
    step = factory(model, config)
    start = libc.sbrk(0)
    shim.shim_phase(1)
    step()
    shim.shim_phase(0)
    grown = (libc.sbrk(0) - start) / (1 << 20)
    with tempfile.NamedTemporaryFile("r", suffix=".txt") as fh:
        shim.shim_dump(fh.name.encode(), start)
        rows = [line.split() for line in fh]
    with open("/proc/self/maps") as fh:
        maps_text = fh.read()
    names = resolve({int(x, 16) for r in rows for x in r[3:] if int(x, 16)}, maps_text)
    blocks = [
        (int(r[2]) / (1 << 20), int(r[1]), labels[int(r[0])], owner([names.get(int(x, 16), "") for x in r[3:]]))
        for r in rows
    ]
    print(f"{model} | {config}: the heap grew by {grown:.1f} MiB in the first step; {len(blocks)} blocks of ≤ 1 KiB")
    print(f"allocated in it are still live above its start ({sum(b[1] for b in blocks) / 1024:.1f} KiB):")
    for (label, who), n in collections.Counter((b[2], b[3]) for b in blocks).most_common():
        print(f"  {n:6d}  {label:40s}  {who}")
    print(f"the {top} highest (MiB above the step's start, bytes, phase, owner):")
    for off, size, label, who in sorted(blocks)[-top:][::-1]:
        print(f"  {off:8.2f}  {size:5d}  {label:40s}  {who}")


def build_shim(directory: str) -> str:
    """Compile :data:`SHIM` with ``cc`` into ``directory``; return the shared library's path.

    Raises:
        subprocess.CalledProcessError: the compiler failed; FileNotFoundError: no ``cc``.
    """
    src, lib = os.path.join(directory, "heap_pins_shim.c"), os.path.join(directory, "heap_pins_shim.so")
    with open(src, "w") as fh:
        fh.write(SHIM)
    subprocess.run(["cc", "-O2", "-fPIC", "-shared", src, "-o", lib, "-ldl"], check=True)
    return lib


def main() -> None:
    """Compile the shim, run :func:`child` under it in a fresh process, print its report."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--model",
        default="gpt2-lora",
        choices=["gpt2", "gpt2-untied", "gpt2-lora", "gpt2-lora-untied", "bert", "lstm"],
        help="a transformer_step.py model",
    )
    ap.add_argument(
        "--config",
        default="dp-sgd",
        choices=["non-private", "dp-sgd", "dp-sgd (PrivacyEngine)"],
        help="the step traced (quote the PrivacyEngine one)",
    )
    ap.add_argument("--top", type=int, default=8, help="how many of the highest live blocks to list")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.model, args.config, args.child, args.top)
        return
    missing = [tool for tool in ("cc", "addr2line") if shutil.which(tool) is None]
    if missing or not sys.platform.startswith("linux"):
        ap.error(f"needs Linux (glibc) with cc and addr2line (binutils); missing: {', '.join(missing) or 'Linux'}")
    with tempfile.TemporaryDirectory() as tmp:
        lib = build_shim(tmp)
        env = dict(os.environ, LD_PRELOAD=lib, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        cmd = [sys.executable, os.path.abspath(__file__), "--model", args.model, "--config", args.config]
        subprocess.run(cmd + ["--top", str(args.top), "--child", lib], env=env, check=True)


if __name__ == "__main__":
    main()
