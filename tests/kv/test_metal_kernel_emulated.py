"""The Metal kernel's source, run on the CPU under a C++ emulation of a threadgroup, equals the plain path.

No Metal device is at hand here, so the kernel's own text (kv/metal_decode_kernel.py's
header and body, unchanged) is compiled as C++17 under a small shim: Metal's address
space words expand to nothing, a threadgroup's lanes run as fibers on one
thread (ucontext), ``simd_sum`` and ``simd_max`` wait for the 32 lanes of their
simdgroup, ``threadgroup_barrier`` for all of them, bfloat16 rounds to nearest even.
That checks the kernel's indexing (strided tails whose buffers hold NaN past their
end, left padding, rows outside the group), its online softmax, the sinks and the
transpose merge against kv/shared_prefix_attention.py on the tiny architectures' head
layouts (a swapped index of the merge or a key read past the end fails it). What it
cannot check: that Metal's compiler takes the source, fast-math exponentials, the
real hardware's simdgroups and memory; test_metal_decode_kernel.py does on a Mac.
"""

from __future__ import annotations

import shutil
import subprocess

import mlx.core as mx
import numpy as np
import pytest

from mlxq.kv import metal_decode_kernel as kernel
from mlxq.kv.shared_prefix_attention import shared_prefix_attention

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ (C++20) to emulate the kernel")

SHIM = r"""
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <ucontext.h>
#include <vector>
#define device
#define constant
#define thread
#define threadgroup static
typedef unsigned int uint;
struct uint3 { uint x, y, z; };
struct bfloat16_t {
  uint16_t bits;
  bfloat16_t() = default;
  bfloat16_t(float f) { uint32_t u; std::memcpy(&u, &f, 4); u += 0x7fff + ((u >> 16) & 1); bits = u >> 16; }
  operator float() const { uint32_t u = uint32_t(bits) << 16; float f; std::memcpy(&f, &u, 4); return f; }
};
// A threadgroup's lanes as fibers on one thread: a lane runs until it waits for its simdgroup
// (a simd_* call) or for the threadgroup (a barrier); the scheduler releases a simdgroup once its 32
// lanes wait, the threadgroup once every lane does. Reductions read a buffer of their generation.
namespace emu {
enum State { RUN, SIMD, TG, DONE };
struct Lane { ucontext_t ctx; State state; int gen; };
inline Lane lanes[1024];
inline int count;  // lanes in this threadgroup
inline std::vector<char> stacks;
inline ucontext_t scheduler;
inline int current;
inline uint sg, lane;
inline float slots[32][2][32];
inline std::function<void(uint, uint)> body;
inline void wait(State s) {
  lanes[current].state = s;
  swapcontext(&lanes[current].ctx, &scheduler);
}
inline void entry() {
  body(current / 32, current % 32);
  lanes[current].state = DONE;
}
inline void run_threadgroup(int n, std::function<void(uint, uint)> f) {
  body = f;
  count = n;
  if (stacks.empty()) stacks.resize(1024 * 65536);
  for (int t = 0; t < count; t++) {
    getcontext(&lanes[t].ctx);
    lanes[t].ctx.uc_stack.ss_sp = stacks.data() + (size_t)t * 65536;
    lanes[t].ctx.uc_stack.ss_size = 65536;
    lanes[t].ctx.uc_link = &scheduler;
    makecontext(&lanes[t].ctx, entry, 0);
    lanes[t].state = RUN;
    lanes[t].gen = 0;
  }
  for (;;) {
    bool ran = false;
    for (int t = 0; t < count; t++) {
      if (lanes[t].state != RUN) continue;
      current = t; sg = t / 32; lane = t % 32; ran = true;
      swapcontext(&scheduler, &lanes[t].ctx);
    }
    int done = 0, at_barrier = 0;
    for (int t = 0; t < count; t++) { done += lanes[t].state == DONE; at_barrier += lanes[t].state == TG; }
    if (done == count) return;
    bool released = false;
    if (at_barrier + done == count) {
      for (int t = 0; t < count; t++) if (lanes[t].state == TG) lanes[t].state = RUN;
      released = true;
    }
    for (int g = 0; g < count / 32; g++) {
      bool all = true;
      for (int l = 0; l < 32; l++) all = all && lanes[g * 32 + l].state == SIMD;
      if (all) { for (int l = 0; l < 32; l++) lanes[g * 32 + l].state = RUN; released = true; }
    }
    if (!ran && !released) { fprintf(stderr, "deadlock\n"); exit(3); }
  }
}
}
namespace metal {
struct mem_flags { static const int mem_threadgroup = 0; };
inline void threadgroup_barrier(int) { emu::wait(emu::TG); }
template <typename F> inline float simd_reduce(float x, F f) {
  const uint g = emu::sg, l = emu::lane;
  const int gen = emu::lanes[emu::current].gen++ % 2;
  emu::slots[g][gen][l] = x;
  emu::wait(emu::SIMD);
  float r = emu::slots[g][gen][0];
  for (int i = 1; i < 32; i++) r = f(r, emu::slots[g][gen][i]);
  return r;
}
inline float simd_sum(float x) { return simd_reduce(x, [](float a, float b) { return a + b; }); }
inline float simd_max(float x) { return simd_reduce(x, [](float a, float b) { return a > b ? a : b; }); }
inline float max(float a, float b) { return a > b ? a : b; }
namespace precise { inline float exp(float x) { return std::exp(x); } }
}
"""

SIGNATURE = """
template <typename T, int D, int G, int SG, bool HAS_PREFIX, bool HAS_SINKS>
void kern(const T* queries, const int* queries_shape,
          const T* prefix_keys, const int* prefix_keys_shape, const int64_t* prefix_keys_strides,
          const T* prefix_values, const int64_t* prefix_values_strides,
          const T* keys, const int* keys_shape, const int64_t* keys_strides,
          const T* values, const int64_t* values_strides,
          const int* starts, const float* scale, const float* sinks, const int* shares, T* out,
          uint3 threadgroup_position_in_grid, uint simdgroup_index_in_threadgroup, uint thread_index_in_simdgroup) {
"""

DRIVER = """
template <typename T, int D, int G, int SG, bool HAS_SINKS>
void run(const char* in, const char* out_path) {
  FILE* f = fopen(in, "rb");
  int meta[8];
  fread(meta, 4, 8, f);
  const int rows = meta[0], heads = meta[1], kvh = meta[2], P = meta[3], own = meta[4], cap = meta[5];
  std::vector<float> q(rows * heads * D), pk(kvh * P * D), pv(kvh * P * D), buf(2 * rows * kvh * cap * D);
  std::vector<float> sinks(heads);
  std::vector<int> starts(rows), shares(rows);
  float scale;
  fread(q.data(), 4, q.size(), f); fread(pk.data(), 4, pk.size(), f); fread(pv.data(), 4, pv.size(), f);
  fread(buf.data(), 4, buf.size(), f); fread(starts.data(), 4, rows, f); fread(shares.data(), 4, rows, f);
  fread(sinks.data(), 4, heads, f); fread(&scale, 4, 1, f);
  fclose(f);
  auto typed = [](const std::vector<float>& v) { return std::vector<T>(v.begin(), v.end()); };
  auto Q = typed(q), PK = typed(pk), PV = typed(pv), B = typed(buf);
  std::vector<T> out(rows * heads * D);
  int qshape[4] = {rows, heads, 1, D}, pshape[4] = {1, kvh, P, D}, kshape[4] = {rows, kvh, own, D};
  int64_t pstr[4] = {(int64_t)kvh * P * D, (int64_t)P * D, D, 1};
  int64_t kstr[4] = {(int64_t)kvh * cap * D, (int64_t)cap * D, D, 1};
  for (int b = 0; b < rows; b++) {
    for (int h = 0; h < kvh; h++) {
      emu::run_threadgroup(SG * 32, [&](uint sg, uint lane) {
        kern<T, D, G, SG, true, HAS_SINKS>(Q.data(), qshape, PK.data(), pshape, pstr, PV.data(), pstr, B.data(), kshape,
                                       kstr, B.data() + (size_t)rows * kvh * cap * D, kstr, starts.data(), &scale,
                                       sinks.data(), shares.data(), out.data(), uint3{(uint)h, (uint)b, 0}, sg, lane);
      });
    }
  }
  FILE* g = fopen(out_path, "wb");
  for (auto& x : out) { float v = float(x); fwrite(&v, 4, 1, g); }
  fclose(g);
}
"""

# (dtype, query heads, KV heads, head width, sinks and rows outside the group): the tiny presets'
# layouts (2/1 and 8/4 of 64, 32/8 of 128) and the widest group the kernel holds (8 per KV head at 128)
CASES = [(mx.float32, 2, 1, 64, True), (mx.float32, 8, 4, 64, False), (mx.float32, 16, 2, 128, True),
         (mx.bfloat16, 32, 8, 128, True)]
CAPACITY = 64  # the tails' buffer length (40 own tokens each)
BOUND = {mx.float32: 1e-5, mx.bfloat16: 2e-2}
C_TYPES = {mx.float32: "float", mx.bfloat16: "bfloat16_t"}


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    """One binary holding every case's instantiation (``./kernel CASE in out``)."""
    root = tmp_path_factory.mktemp("metal-emulation")
    calls = "\n".join(f"  if (which == {i}) run<{C_TYPES[dtype]}, {dim}, {heads // kv_heads}, {kernel.SIMDGROUPS}, "
                      f"{str(sinks).lower()}>"
                      "(argv[2], argv[3]);" for i, (dtype, heads, kv_heads, dim, sinks) in enumerate(CASES))
    source = (SHIM + kernel._HEADER + SIGNATURE + kernel._SOURCE + "\n}\n" + DRIVER
              + f"\nint main(int argc, char** argv) {{\n  const int which = atoi(argv[1]);\n{calls}\n}}\n")
    (root / "kernel.cpp").write_text(source)
    built = subprocess.run(["g++", "-std=c++17", "-O1", "-w", "kernel.cpp", "-o", "kernel"], cwd=root,
                           capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-3000:]
    return root


@pytest.mark.parametrize("case", range(len(CASES)))
def test_the_emulated_kernel_equals_the_plain_path(emulator, case):
    dtype, heads, kv_heads, dim, extras = CASES[case]
    rows, prefix, own = 4, 333, 40
    q, pk, pv, tk, tv, starts, scale = kernel.check_inputs(dtype, heads, kv_heads, dim, rows, prefix, own)
    # the tails as views of a longer buffer, as the caches hold them; past their end NaN: a stray read shows
    buffer = mx.concatenate([mx.stack([tk, tv]).astype(mx.float32),
                             mx.full((2, rows, kv_heads, CAPACITY - own, dim), float("nan"))], axis=3)
    sinks = mx.random.normal((heads,), key=mx.random.key(7)) if extras else None
    shares = mx.array([b % 3 != 1 for b in range(rows)]) if extras else None
    want = shared_prefix_attention(q, pk, pv, tk, tv, starts, scale, sinks, None, shares).astype(mx.float32)

    def raw(a, kind=np.float32):
        return np.asarray(a.astype(mx.float32) if kind is np.float32 else a, dtype=kind).ravel().tobytes()

    marks = mx.ones((rows,), mx.int32) if shares is None else shares.astype(mx.int32)
    meta = np.array([rows, heads, kv_heads, prefix, own, CAPACITY, 0, 0], np.int32)
    parts = [meta.tobytes(), raw(q), raw(pk), raw(pv), raw(buffer), raw(starts, np.int32), raw(marks, np.int32),
             raw(sinks if sinks is not None else mx.zeros((heads,))), np.float32(scale).tobytes()]
    (emulator / f"in{case}.bin").write_bytes(b"".join(parts))
    subprocess.run(["./kernel", str(case), f"in{case}.bin", f"out{case}.bin"], cwd=emulator, check=True, timeout=120)
    got = np.fromfile(emulator / f"out{case}.bin", np.float32).reshape(want.shape)
    assert float(np.abs(got - np.array(want)).max()) < BOUND[dtype]
