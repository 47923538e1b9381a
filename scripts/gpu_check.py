#!/usr/bin/env python3
"""The GPU check of scripts/gpu-check.sh (Python standard library only: it runs on a GPU machine whose python3 has
a PyTorch wheel and nothing else, and on a development machine without torch for Python).

Steps, each recorded in OUTDIR/report.json and OUTDIR/report.md:
  build        the model-only tree (-DSKYREELS_MODEL_ONLY=ON) against the machine's LibTorch: a PyTorch wheel's
               (torch.utils.cmake_prefix_path) when python3 has torch, else the system's; gpu-deps/ (scripts/gpu-deps.sh)
               unpacked and put on CMAKE_PREFIX_PATH when present; CUDA architecture 9.0; every core.
  placement    every checkpoint layout of the golden transformer cases (diffusers scale_shift_table, sharded, original,
               the PR #11850 norm_out.linear layout, bf16 weights) loaded by `skyreels forward` straight onto the
               device: every parameter and buffer there, none on meta or another device (the loader refuses
               otherwise and forward prints what it checked), and run.
  transformer  those runs against diffusers' fp32 outputs: |ours - golden| <= 1e-4 + 1e-4 |golden| (TF32 off), and
               bfloat16 compute against the same fp32 outputs within 5e-2 + 5e-2 |golden| (the fixtures' bf16 rule).
  pipelines    `skyreels generate` of every DF, I2V and V2V fixture with its recorded noise (1e-4), and two seeded runs
               against the same runs on the CPU (1e-4); host-device synchronisations per transformer call on CUDA.
  parallel     `skyreels generate --devices D,D --parallel cfg=2 | ulysses=2 [--shard-weights]` of a DF fixture
               against one device (1e-5) and diffusers (1e-4): cuda:0,cuda:1 on a machine with two GPUs, else two
               ranks on the one device.
  vae          `skyreels decode` of the VAE fixture (1e-4).
  speed        bench_transformer: DF-1.3B (30 layers, random weights) at 25x68x120 latents (97 frames of 540P),
               bfloat16, seconds per pass and MFU against the matmul rate measured in the same process; DF-14B width
               with 4 of its 40 layers; bench_vae: decode of 25 latent frames (97 frames) at 540P, time and peak
               memory. diffusers' own transformer is timed alongside when its source is carried (gpu-deps/diffusers/src)
               and importable by python3 with torch; otherwise the report says so.
--cpu runs every step on the CPU at tiny sizes (the same code paths; the speed step in float32: bf16 on a CPU
without bf16 units takes minutes), so the script is tested on every machine.
"""
import argparse
import json
import math
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from array import array
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GOLDEN = REPO / "tests" / "data" / "golden"
FP32_TOL = (1e-4, 1e-4)
BF16_TOL = (5e-2, 5e-2)


# ---- safetensors (little-endian F32 / F64 / BF16 / I64) without numpy or torch ----------------------------------

def load_safetensors(path):
    data = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        raw = data[base + begin:base + end]
        dtype = info["dtype"]
        if dtype == "F32":
            values = array("f")
            values.frombytes(raw)
        elif dtype == "F64":
            values = array("d")
            values.frombytes(raw)
        elif dtype == "BF16":
            halves = array("H")
            halves.frombytes(raw)
            values = array("f")
            values.frombytes(b"".join(struct.pack("<I", h << 16) for h in halves))
        elif dtype == "I64":
            values = array("q")
            values.frombytes(raw)
        else:
            continue
        if sys.byteorder != "little":
            values.byteswap()
        out[name] = (info["shape"], values)
    return out


def compare(actual, expected, tol):
    """(ok, max |diff|, elements out of tolerance) of |a - e| <= atol + rtol |e| elementwise."""
    (shape_a, a), (shape_e, e) = actual, expected
    if list(shape_a) != list(shape_e):
        return False, math.inf, -1
    atol, rtol = tol
    worst, over = 0.0, 0
    for x, y in zip(a, e):
        d = abs(x - y)
        if d != d:  # NaN
            over += 1
            worst = math.inf
            continue
        worst = max(worst, d)
        if d > atol + rtol * abs(y):
            over += 1
    return over == 0, worst, over


# ---- running things ---------------------------------------------------------------------------------------------

class Check:
    def __init__(self, out_dir, device, cpu):
        self.out = Path(out_dir)
        self.device = device
        self.cpu = cpu
        self.steps = {}
        self.failures = []
        self.log = open(self.out / "commands.log", "w")
        self.tmp = Path(tempfile.mkdtemp(prefix="gpu-check-"))

    def run(self, cmd, env=None, timeout=900):
        start = time.time()
        self.log.write("$ " + " ".join(str(c) for c in cmd) + "\n")
        self.log.flush()
        full_env = dict(os.environ)
        full_env.update(env or {})
        proc = subprocess.run([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=full_env, timeout=timeout)
        self.log.write(proc.stdout[-20000:] + f"[exit {proc.returncode} in {time.time() - start:.1f} s]\n")
        self.log.flush()
        return proc.returncode, proc.stdout, time.time() - start

    def fail(self, step, what):
        self.failures.append(f"{step}: {what}")


def torch_prefix():
    """The PyTorch wheel's CMake prefix when python3 has torch (the GPU machine), else None."""
    try:
        out = subprocess.run([sys.executable, "-c", "import torch; print(torch.utils.cmake_prefix_path); "
                              "print(torch.__version__)"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None, None
    if out.returncode != 0:
        return None, None
    lines = out.stdout.split()
    return lines[0], lines[1]


def build(chk, build_dir, jobs):
    step = {"build_dir": str(build_dir)}
    prefixes = []
    prefix, version = torch_prefix()
    if prefix:
        prefixes.append(prefix)
        step["libtorch"] = f"PyTorch wheel {version} ({prefix})"
    else:
        step["libtorch"] = "the system's (find_package(Torch) default search)"
    deps = REPO / "gpu-deps"
    if (deps / "debs").is_dir():
        if not (deps / "root" / "usr").is_dir():
            rc, out, _ = chk.run(["bash", REPO / "scripts" / "gpu-deps.sh", "--extract"])
            if rc != 0:
                chk.fail("build", "gpu-deps --extract failed")
        prefixes.append(str(deps / "root" / "usr"))
        step["gpu_deps"] = str(deps / "root" / "usr")
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    env = {"TORCH_CUDA_ARCH_LIST": "9.0"}
    if not shutil.which("nvcc") and Path("/usr/local/cuda/bin/nvcc").exists():
        env["CUDACXX"] = "/usr/local/cuda/bin/nvcc"
    configure = ["cmake", "-S", REPO, "-B", build_dir, *generator, "-DCMAKE_BUILD_TYPE=Release",
                 "-DSKYREELS_MODEL_ONLY=ON", "-DCMAKE_CUDA_ARCHITECTURES=90", "-DTORCH_CUDA_ARCH_LIST=9.0", "-DCMAKE_POLICY_VERSION_MINIMUM=3.5"]
    if prefixes:
        configure.append("-DCMAKE_PREFIX_PATH=" + ";".join(prefixes))
    rc, out, seconds = chk.run(configure, env=env)
    step["configure_s"] = round(seconds, 1)
    m = re.search(r"LibTorch (\S+) with CUDA (\S*)", out)
    step["cuda_build"] = bool(m)
    if m:
        step["libtorch_version"], step["cuda_version"] = m.group(1), m.group(2)
    if rc != 0:
        chk.fail("build", "configure failed (commands.log)")
        step["ok"] = False
        return step
    rc, out, seconds = chk.run(["cmake", "--build", build_dir, "-j", str(jobs), "--target", "skyreels",
                                "bench_transformer", "bench_vae"], env=env, timeout=1800)
    step["build_s"] = round(seconds, 1)
    step["jobs"] = jobs
    step["ok"] = rc == 0
    if rc != 0:
        chk.fail("build", "build failed (commands.log)")
    return step


# ---- steps --------------------------------------------------------------------------------------------------------

PLACEMENT = re.compile(r"placement: (\d+) tensors on (\S+) \((\d+) float32\), none on meta or another device")


def forward_cases(chk, bin_dir):
    placement, parity = [], []
    cases = sorted(p for p in (GOLDEN / "transformer_forward").iterdir() if (p / "case.json").exists())
    if chk.cpu:
        cases = [c for c in cases if c.name in ("t1_tiny_df_fps", "t3_block_causal_nfpb2", "t6_bf16_checkpoint")]
    for case in cases:
        golden = load_safetensors(case / "output.safetensors")["sample"]
        layouts = sorted(p.name for p in (case / "weights").iterdir() if p.is_dir())
        runs = [(layout, "float32") for layout in layouts]
        if case.name == "t6_bf16_checkpoint":
            runs += [(layout, "bfloat16") for layout in layouts]
        elif not chk.cpu:
            runs.append(("diffusers", "bfloat16"))
        for layout, dtype in runs:
            out = chk.tmp / f"{case.name}-{layout}-{dtype}.safetensors"
            rc, log, seconds = chk.run([bin_dir / "skyreels", "forward", "--model", case / "weights" / layout,
                                        "--inputs", case / "inputs.safetensors", "--out", out, "--device",
                                        chk.device, "--dtype", dtype])
            entry = {"case": case.name, "layout": layout, "dtype": dtype, "seconds": round(seconds, 2)}
            m = PLACEMENT.search(log)
            entry["tensors_on_device"] = int(m.group(1)) if m else 0
            entry["placed_on"] = m.group(2) if m else None
            want = chk.device if ":" in chk.device else chk.device + (":0" if chk.device == "cuda" else "")
            entry["placement_ok"] = rc == 0 and m is not None and m.group(2) == want
            placement.append(entry)
            if not entry["placement_ok"]:
                chk.fail("placement", f"{case.name}/{layout} {dtype}: exit {rc}, placement line {m.group(0) if m else 'missing'}")
                continue
            tol = FP32_TOL if dtype == "float32" else BF16_TOL
            ok, worst, over = compare(load_safetensors(out)["sample"], golden, tol)
            parity.append({"case": case.name, "layout": layout, "dtype": dtype, "max_abs_diff": worst,
                           "out_of_tolerance": over, "tolerance": f"{tol[0]:g} + {tol[1]:g}|golden|", "ok": ok})
            if not ok:
                chk.fail("transformer", f"{case.name}/{layout} {dtype}: max |diff| {worst:.3g}, {over} out of tolerance")
    return placement, parity


def generate_flags(case):
    cj = json.loads((case / "case.json").read_text())
    kw = dict(cj["call_defaults_in_effect"])
    kw.update(cj["call_kwargs"])
    flags = ["--model", case / "weights" / "diffusers", "--inputs", case / "inputs.safetensors",
             "--num-frames", kw["num_frames"], "--height", kw["height"], "--width", kw["width"],
             "--num-inference-steps", kw["num_inference_steps"], "--guidance-scale", kw["guidance_scale"],
             "--scheduler-config", case / "scheduler" / "scheduler_config.json"]
    for key in ("base_num_frames", "ar_step", "addnoise_condition", "overlap_history", "causal_block_size"):
        if kw.get(key) is not None:
            flags += ["--" + key.replace("_", "-"), kw[key]]
    inputs = load_safetensors(case / "inputs.safetensors")
    if (case / "weights" / "vae").is_dir():
        flags += ["--vae", case / "weights" / "vae"]
        for key in ("image", "last_image", "video"):
            if key in inputs:
                flags += ["--" + key.replace("_", "-"), case / "inputs.safetensors"]
    seed = int(re.search(r"manual_seed\((\d+)\)", kw["generator"]).group(1))
    return flags, seed


SYNCS = re.compile(r"host_syncs: (\d+) in (\d+) transformer calls")


def pipelines(chk, bin_dir):
    results, syncs = [], []
    cases = []
    for kind in ("pipeline_df", "pipeline_df_i2v", "pipeline_df_v2v"):
        cases += sorted(p for p in (GOLDEN / kind).iterdir() if (p / "case.json").exists())
    if chk.cpu:
        cases = [c for c in cases if c.name in ("p2_async_cbs2_ar2", "i1_sync_1chunk_last_image", "v1_single_chunk")]
    for case in cases:
        flags, seed = generate_flags(case)
        golden = load_safetensors(case / "output.safetensors")
        out = chk.tmp / f"{case.parent.name}-{case.name}.safetensors"
        rc, log, seconds = chk.run([bin_dir / "skyreels", "generate", *flags, "--noise", case / "noise.safetensors",
                                    "--device", chk.device, "--count-host-syncs", "--out", out])
        entry = {"case": f"{case.parent.name}/{case.name}", "noise": "recorded", "seconds": round(seconds, 2)}
        if rc != 0:
            entry.update(ok=False, error=f"exit {rc}")
            chk.fail("pipelines", f"{entry['case']}: generate exit {rc}")
            results.append(entry)
            continue
        produced = load_safetensors(out)
        worst, ok = 0.0, True
        for name, expected in golden.items():
            if name not in produced:
                ok = False
                continue
            good, diff, _ = compare(produced[name], expected, FP32_TOL)
            ok, worst = ok and good, max(worst, diff)
        entry.update(ok=ok, max_abs_diff=worst, tolerance="1e-4 + 1e-4|golden|")
        results.append(entry)
        if not ok:
            chk.fail("pipelines", f"{entry['case']}: max |diff| {worst:.3g}")
        m = SYNCS.search(log)
        if m:
            calls = int(m.group(2))
            syncs.append({"case": entry["case"], "host_syncs": int(m.group(1)), "transformer_calls": calls,
                          "per_call": round(int(m.group(1)) / max(calls, 1), 2)})
    # Seeded runs: the device against the CPU (the noise is drawn on the CPU either way).
    seeded = []
    seed_cases = [GOLDEN / "pipeline_df_i2v" / "i2_long_3chunks_overlap9", GOLDEN / "pipeline_df_v2v" / "v2_long_3chunks"]
    if chk.cpu:
        seed_cases = seed_cases[1:]
    for case in seed_cases:
        flags, seed = generate_flags(case)
        outs = {}
        for dev in ([chk.device, "cpu"] if chk.device != "cpu" else ["cpu"]):
            outs[dev] = chk.tmp / f"seed-{case.name}-{dev.replace(':', '')}.safetensors"
            rc, _, _ = chk.run([bin_dir / "skyreels", "generate", *flags, "--seed", seed, "--device", dev,
                                "--out", outs[dev]])
            if rc != 0:
                chk.fail("pipelines", f"seeded {case.name} on {dev}: exit {rc}")
        if not all(p.exists() for p in outs.values()):
            continue
        ref = load_safetensors(outs["cpu"])["latents"]
        ok, worst, _ = compare(load_safetensors(outs[chk.device])["latents"], ref, FP32_TOL)
        # The golden output too: the seed reproduces diffusers' own run when addnoise_condition is off.
        gold_ok, gold_worst, _ = compare(ref, load_safetensors(case / "output.safetensors")["latents"], FP32_TOL)
        seeded.append({"case": f"{case.parent.name}/{case.name}", "seed": seed, "device_vs_cpu_max_abs_diff": worst,
                       "cpu_vs_golden_max_abs_diff": gold_worst, "ok": ok and gold_ok})
        if not (ok and gold_ok):
            chk.fail("pipelines", f"seeded {case.name}: device vs cpu {worst:.3g}, cpu vs golden {gold_worst:.3g}")
    return results, seeded, syncs


def gpu_count():
    try:
        out = subprocess.run(["nvidia-smi", "-L"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                             timeout=30)
        return len([l for l in out.stdout.splitlines() if l.startswith("GPU ")]) if out.returncode == 0 else 0
    except (OSError, subprocess.TimeoutExpired):
        return 0


def parallel(chk, bin_dir):
    """One video on several ranks (issue 43): a guided DF fixture with --parallel cfg=2 and ulysses=2 against the
    same call on one device (1e-5) and against diffusers (1e-4). Two GPUs when the machine has them, else two ranks
    on the one device (the exchanges then go through the host, as Gloo stages them)."""
    case = GOLDEN / "pipeline_df" / "p2_async_cbs2_ar2"
    flags, _ = generate_flags(case)
    golden = load_safetensors(case / "output.safetensors")["latents"]
    two = "cpu,cpu" if chk.cpu else ("cuda:0,cuda:1" if gpu_count() >= 2 else f"{chk.device},{chk.device}")
    base = [bin_dir / "skyreels", "generate", *flags, "--noise", case / "noise.safetensors"]
    one_out = chk.tmp / "parallel-one.safetensors"
    rc, _, one_s = chk.run([*base, "--device", chk.device, "--out", one_out])
    results = []
    if rc != 0:
        chk.fail("parallel", f"one device: exit {rc}")
        return results
    one = load_safetensors(one_out)["latents"]
    for layout in ("cfg=2", "ulysses=2", "ulysses=2 --shard-weights"):
        out = chk.tmp / f"parallel-{layout.replace(' ', '').replace('=', '')}.safetensors"
        rc, log, seconds = chk.run([*base, "--devices", two, "--parallel", *layout.split(), "--out", out])
        entry = {"layout": layout, "devices": two, "seconds": round(seconds, 2), "one_device_seconds": round(one_s, 2)}
        if rc != 0:
            if "which this build lacks" in log:  # no Gloo headers where this tree was built: nothing to check
                entry.update(ok=True, note="this build has no c10d Gloo (a replica is one device)")
            else:
                entry.update(ok=False, error=f"exit {rc}")
                chk.fail("parallel", f"{layout} on {two}: exit {rc}")
            results.append(entry)
            continue
        produced = load_safetensors(out)["latents"]
        ok_one, diff_one, _ = compare(produced, one, (1e-5, 0.0))
        ok_gold, diff_gold, _ = compare(produced, golden, FP32_TOL)
        entry.update(ok=ok_one and ok_gold, vs_one_device=diff_one, vs_golden=diff_gold)
        results.append(entry)
        if not entry["ok"]:
            chk.fail("parallel", f"{layout} on {two}: vs one device {diff_one:.3g}, vs golden {diff_gold:.3g}")
    return results


def vae(chk, bin_dir):
    case = GOLDEN / "vae_decode" / "v1_tiny_decode"
    out = chk.tmp / "vae.safetensors"
    rc, _, seconds = chk.run([bin_dir / "skyreels", "decode", "--vae", case / "weights" / "diffusers", "--latents",
                              case / "inputs.safetensors", "--out", out, "--device", chk.device])
    if rc != 0:
        chk.fail("vae", f"decode exit {rc}")
        return {"ok": False}
    ok, worst, over = compare(load_safetensors(out)["video"], load_safetensors(case / "output.safetensors")["video"],
                              FP32_TOL)
    if not ok:
        chk.fail("vae", f"decode max |diff| {worst:.3g}")
    return {"case": "vae_decode/v1_tiny_decode", "ok": ok, "max_abs_diff": worst, "seconds": round(seconds, 2),
            "tolerance": "1e-4 + 1e-4|golden|"}


def parse_result(text):
    line = next((l for l in text.splitlines() if l.startswith("RESULT ")), None)
    if line is None:
        return None
    return {k: v for k, v in (kv.split("=", 1) for kv in line.split()[1:] if "=" in kv)}


def speed(chk, bin_dir):
    # bf16 on the GPU; the CPU run checks the same steps in fp32 (on a CPU without bf16 units, AMD EPYC Zen 2/3 say,
    # one tiny bf16 pass takes minutes).
    dtype = "float32" if chk.cpu else "bfloat16"
    out = {"dtype": dtype}
    if chk.cpu:
        shapes = {"df_1_3b": ["--config", "df-1.3b", "--layers", "2", "--frames", "5", "--height", "8", "--width", "8",
                              "--text", "16"],
                  "df_14b": ["--config", "df-14b", "--layers", "1", "--frames", "2", "--height", "4", "--width", "4",
                             "--text", "8"]}
        vae_args = ["--single", "2", "--height", "32", "--width", "32", "--base-dim", "16"]
    else:
        shapes = {"df_1_3b": ["--config", "df-1.3b", "--layers", "30", "--frames", "25", "--height", "68", "--width",
                              "120", "--text", "512"],
                  "df_14b": ["--config", "df-14b", "--layers", "4", "--frames", "25", "--height", "68", "--width",
                             "120", "--text", "512"]}
        vae_args = ["--single", "25", "--height", "544", "--width", "960"]
    for name, args in shapes.items():
        repeats = ["--warmup", "0", "--repeats", "1"] if chk.cpu else ["--warmup", "1", "--repeats", "3"]
        rc, log, _ = chk.run([bin_dir / "bench_transformer", "--single", "--dtype", dtype, "--device", chk.device,
                              *repeats, "--peak", *args])
        r = parse_result(log) if rc == 0 else None
        if r is None:
            chk.fail("speed", f"bench_transformer {name}: exit {rc}")
            continue
        out[name] = {"layers": int(r["layers"]), "latent": r["latent"], "tokens": int(r["tokens"]),
                     "seconds_per_pass": float(r["forward_s(best)"]), "tflop_per_pass": float(r["tflop"]),
                     "achieved_tflops": float(r["gflops(best)"]) / 1e3, "matmul_peak_tflops": float(r["matmul_tflops"]),
                     "mfu": float(r["mfu"]), "peak_device_mib": float(r["peak_device_mib"]),
                     "finite": r["finite"] == "1"}
        if r["finite"] != "1":
            chk.fail("speed", f"{name}: non-finite output")
    rc, log, _ = chk.run([bin_dir / "bench_vae", "--mode", "stream", "--dtype", dtype, "--device", chk.device,
                          "--frames-per-call", "0", *vae_args])
    line = next((l for l in log.splitlines() if l.startswith("RESULT ")), None)
    if rc != 0 or line is None:
        chk.fail("speed", f"bench_vae: exit {rc}")
    else:
        f = line.split()
        out["vae_decode"] = {"latent_frames": int(f[1]), "pixel_frames": int(f[2]), "seconds": float(f[3]),
                             "peak_rss_mib": float(f[6]), "peak_device_mib": float(f[9]) if len(f) > 9 else 0.0,
                             "size": f"{vae_args[vae_args.index('--width') + 1]}x{vae_args[vae_args.index('--height') + 1]}"}
    out["diffusers"] = diffusers_speed(chk, shapes["df_1_3b"], dtype)
    if "seconds_per_pass" in out["diffusers"] and "df_1_3b" in out:
        out["diffusers"]["ours_speedup"] = round(out["diffusers"]["seconds_per_pass"] / out["df_1_3b"]["seconds_per_pass"], 3)
    return out


def diffusers_speed(chk, args, dtype):
    src = REPO / "gpu-deps" / "diffusers" / "src"
    if not src.is_dir():
        return {"status": "not run: diffusers' source is not carried (gpu-deps/diffusers/src); ours and MFU only"}
    opts = dict(zip(args[0::2], args[1::2]))
    script = f"""
import sys, time, torch
sys.path.insert(0, {str(src)!r})
from diffusers import SkyReelsV2Transformer3DModel
dev = {chk.device!r}
# DF-1.3B's config (diffusers' defaults otherwise, as TransformerConfig::df_1_3b); diffusers' own random init.
m = SkyReelsV2Transformer3DModel(num_attention_heads=12, ffn_dim=8960, num_layers={opts['--layers']},
                                 inject_sample_info=True).to(dev, torch.{dtype}).eval()
x = torch.randn(1, 16, {opts['--frames']}, {opts['--height']}, {opts['--width']}, device=dev, dtype=torch.{dtype})
t = torch.randint(0, 1000, (1, {opts['--frames']}), device=dev)
e = torch.randn(1, {opts['--text']}, 4096, device=dev, dtype=torch.{dtype}) * 0.1
fps = torch.ones(1, dtype=torch.long, device=dev)
best = 1e30
with torch.no_grad():
    for i in range(4):
        if dev.startswith('cuda'): torch.cuda.synchronize()
        s = time.time(); m(x, t, e, enable_diffusion_forcing=True, fps=fps, return_dict=False)
        if dev.startswith('cuda'): torch.cuda.synchronize()
        if i: best = min(best, time.time() - s)
print('DIFFUSERS', best)
"""
    rc, log, _ = chk.run([sys.executable, "-c", script])
    m = re.search(r"DIFFUSERS (\S+)", log)
    if rc != 0 or not m:
        return {"status": f"failed (exit {rc}; commands.log)"}
    return {"status": "run", "seconds_per_pass": float(m.group(1))}


# ---- report -----------------------------------------------------------------------------------------------------

def write_report(chk, report):
    (chk.out / "report.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    lines = [f"# GPU check: {report['verdict']}", "",
             f"- device: {report['device']} ({report['device_name']}); mode: {'cpu (tiny sizes)' if chk.cpu else 'gpu'}",
             f"- when: {report['when']}, total {report['total_s']} s"]
    b = report.get("build", {})
    if "reused" in b:
        lines.append(f"- build: reused the binaries in {b['reused']}")
    elif b:
        lines.append(f"- build: {b.get('libtorch')}, CUDA build {b.get('cuda_build')} {b.get('cuda_version', '')}, "
                     f"configure {b.get('configure_s')} s, build {b.get('build_s')} s with {b.get('jobs')} jobs")
    if report["failures"]:
        lines += ["", "## Failures", ""] + [f"- {f}" for f in report["failures"]]
    lines += ["", "## Device exactness (every tensor on the device, none on meta/CPU)", "",
              "| case | layout | dtype | tensors on device | on | ok |", "|---|---|---|---|---|---|"]
    for p in report["placement"]:
        lines.append(f"| {p['case']} | {p['layout']} | {p['dtype']} | {p['tensors_on_device']} | {p['placed_on']} | "
                     f"{'yes' if p['placement_ok'] else 'NO'} |")
    lines += ["", "## Parity with diffusers' golden fixtures", "",
              "| what | case | dtype / noise | max abs diff | tolerance | ok |", "|---|---|---|---|---|---|"]
    for p in report["transformer"]:
        lines.append(f"| transformer ({p['layout']}) | {p['case']} | {p['dtype']} | {p['max_abs_diff']:.3g} | "
                     f"{p['tolerance']} | {'yes' if p['ok'] else 'NO'} |")
    for p in report["pipelines"]:
        lines.append(f"| generate | {p['case']} | recorded noise | {p.get('max_abs_diff', float('nan')):.3g} | 1e-4 + 1e-4|g| | "
                     f"{'yes' if p['ok'] else 'NO'} |")
    for p in report["seeded"]:
        lines.append(f"| generate --seed | {p['case']} | seed {p['seed']} | device vs cpu "
                     f"{p['device_vs_cpu_max_abs_diff']:.3g}, cpu vs golden {p['cpu_vs_golden_max_abs_diff']:.3g} | "
                     f"1e-4 + 1e-4|g| | {'yes' if p['ok'] else 'NO'} |")
    for p in report.get("parallel", []):
        detail = (p.get("note") or p.get("error") or
                  f"vs one device {p['vs_one_device']:.3g}, vs golden {p['vs_golden']:.3g} "
                  f"({p['seconds']} s, one device {p['one_device_seconds']} s)")
        lines.append(f"| generate --parallel {p['layout']} | pipeline_df/p2_async_cbs2_ar2 on {p['devices']} | "
                     f"recorded noise | {detail} | 1e-5 vs one device | {'yes' if p['ok'] else 'NO'} |")
    v = report.get("vae", {})
    if "max_abs_diff" in v:
        lines.append(f"| decode | {v['case']} | float32 | {v['max_abs_diff']:.3g} | {v['tolerance']} | "
                     f"{'yes' if v['ok'] else 'NO'} |")
    lines += ["", "## Host-device synchronisations in the step loop", ""]
    if report["host_syncs"]:
        lines += ["| case | syncs | transformer calls | per call |", "|---|---|---|---|"]
        lines += [f"| {s['case']} | {s['host_syncs']} | {s['transformer_calls']} | {s['per_call']} |"
                  for s in report["host_syncs"]]
    else:
        lines.append("not counted (no CUDA device: LibTorch's sync debug mode is CUDA's)")
    s = report.get("speed", {})
    lines += ["", f"## Speed ({s.get('dtype', 'bfloat16')}, random weights)", "",
              "| model | layers | latents | tokens | s / pass | TFLOP / pass | achieved TFLOP/s | matmul peak TFLOP/s | MFU | peak device MiB |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for name in ("df_1_3b", "df_14b"):
        if name in s:
            r = s[name]
            lines.append(f"| {name} | {r['layers']} | {r['latent']} | {r['tokens']} | {r['seconds_per_pass']:.3f} | "
                         f"{r['tflop_per_pass']:.3g} | {r['achieved_tflops']:.3g} | {r['matmul_peak_tflops']:.3g} | "
                         f"{100 * r['mfu']:.1f} % | {r['peak_device_mib']:.0f} |")
    if "vae_decode" in s:
        r = s["vae_decode"]
        lines.append(f"\nVAE decode of {r['latent_frames']} latent frames ({r['pixel_frames']} frames) at {r['size']}: "
                     f"{r['seconds']:.2f} s, peak device memory {r['peak_device_mib']:.0f} MiB, peak RSS {r['peak_rss_mib']:.0f} MiB")
    d = s.get("diffusers", {})
    lines.append(f"\ndiffusers' SkyReelsV2Transformer3DModel: {d.get('status')}" +
                 (f", {d['seconds_per_pass']:.3f} s / pass (ours {d.get('ours_speedup')}x as fast)" if "seconds_per_pass" in d else ""))
    (chk.out / "report.md").write_text("\n".join(lines) + "\n")


def device_name(chk, bin_dir):
    if chk.cpu:
        return "cpu"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, timeout=30)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unknown GPU"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown GPU"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("outdir")
    ap.add_argument("--cpu", action="store_true", help="every step on the CPU at tiny sizes")
    ap.add_argument("--bin", help="use the binaries in this folder (skyreels, bench_transformer, bench_vae) instead "
                    "of building the model-only tree")
    ap.add_argument("--build-dir", help="model-only build folder (default build-gpu, or build-gpu-cpu with --cpu)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    a = ap.parse_args()
    start = time.time()
    out = Path(a.outdir)
    out.mkdir(parents=True, exist_ok=True)
    chk = Check(out, "cpu" if a.cpu else "cuda:0", a.cpu)
    report = {"when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "device": chk.device,
              "mode": "cpu" if a.cpu else "gpu", "placement": [], "transformer": [], "pipelines": [], "seeded": [],
              "parallel": [],
              "host_syncs": [], "tolerances": {"fp32": "1e-4 + 1e-4|golden|", "bf16_vs_fp32": "5e-2 + 5e-2|golden|"}}
    if a.bin:
        bin_dir = Path(a.bin).resolve()
        report["build"] = {"reused": str(bin_dir)}
    else:
        build_dir = Path(a.build_dir or (REPO / ("build-gpu-cpu" if a.cpu else "build-gpu"))).resolve()
        report["build"] = build(chk, build_dir, a.jobs)
        bin_dir = build_dir / "bin"
    report["device_name"] = device_name(chk, bin_dir)
    env_note = {"SKYREELS_TF32": os.environ.get("SKYREELS_TF32", "unset (TF32 off)")}
    report["environment"] = env_note
    if report["build"].get("ok", True):
        report["placement"], report["transformer"] = forward_cases(chk, bin_dir)
        report["pipelines"], report["seeded"], report["host_syncs"] = pipelines(chk, bin_dir)
        report["parallel"] = parallel(chk, bin_dir)
        report["vae"] = vae(chk, bin_dir)
        report["speed"] = speed(chk, bin_dir)
    report["failures"] = chk.failures
    report["verdict"] = "PASS" if not chk.failures else f"FAIL ({len(chk.failures)})"
    report["total_s"] = round(time.time() - start, 1)
    write_report(chk, report)
    shutil.rmtree(chk.tmp, ignore_errors=True)
    print((out / "report.md").read_text())
    return 0 if not chk.failures else 1


if __name__ == "__main__":
    sys.exit(main())
