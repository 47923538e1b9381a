"""diffusers' own code from its source tree on Debian 12's Python (torch 1.13), for the references and benchmarks that
run it: tests/data/per_block_cache/make_cases.py, tests/data/euler/make_cases.py, bench/diffusers_pipeline_time.py.

Nothing of diffusers is changed. Its package __init__ files that import every model eagerly (some need a newer
torch) are replaced by lazy packages; torch 1.13 gets the few names diffusers' import path touches (dtype and device
tables, torch.compiler.disable) and, on the numeric path, torch.nn.RMSNorm (at::rms_norm semantics) and
F.scaled_dot_product_attention (the documented reference math: bool mask True = attend, a row without keys gives
0); huggingface_hub, safetensors and transformers, which Debian 12 lacks and this path never calls, are stubbed.
Debian packages it needs: python3-torch python3-numpy python3-packaging python3-filelock python3-requests
python3-regex python3-pil python3-tqdm python3-httpx python3-yaml (scripts/python_deps.py lists and checks them: torch
and numpy on import, every one before diffusers is imported; scripts/bench-deps.sh installs them). An importer
imports this module before torch, so that a missing package is named in the first line of the error.
"""
import argparse
import importlib
import json
import os
import re
import struct
import sys
import tempfile
import types

import python_deps  # standard library only

python_deps.require(python_deps.TORCH_PACKAGES)
import numpy as np  # noqa: E402
import torch  # noqa: E402


# ---- torch 1.13 and the missing packages -----------------------------------------------------------------------

def polyfill_torch():
    noop = lambda *a, **k: None
    for dev in ["xpu", "mps", "npu", "mlu", "musa"]:
        if not hasattr(torch, dev):
            setattr(torch, dev, types.SimpleNamespace(empty_cache=noop, device_count=lambda: 0,
                                                      is_available=lambda: False, manual_seed=noop,
                                                      reset_peak_memory_stats=noop, synchronize=noop,
                                                      max_memory_allocated=lambda *a: 0))
    if not hasattr(torch, "compiler"):
        disable = lambda fn=None, *a, **k: fn if fn is not None else (lambda f: f)
        torch.compiler = types.SimpleNamespace(disable=disable, is_compiling=lambda: False,
                                               is_dynamo_compiling=lambda: False)
    for name in ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "uint16", "uint32", "uint64"]:
        if not hasattr(torch, name):
            setattr(torch, name, torch.uint8)  # dtype tables of quantizers only, never on the numeric path
    importlib.import_module("torch.distributed")
    if not hasattr(torch.distributed, "device_mesh"):
        torch.distributed.device_mesh = types.SimpleNamespace(DeviceMesh=object, init_device_mesh=noop)
    for name in ["torch.distributed._functional_collectives", "torch.distributed.tensor"]:
        try:
            importlib.import_module(name)
        except Exception:
            module = types.ModuleType(name)
            module.__getattr__ = lambda attr: object
            sys.modules[name] = module

    class RMSNorm(torch.nn.Module):  # at::rms_norm semantics (fp32 here)
        def __init__(self, dim, eps=None, elementwise_affine=True):
            super().__init__()
            self.eps = eps
            self.weight = torch.nn.Parameter(torch.ones(dim)) if elementwise_affine else None

        def forward(self, x):
            eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
            y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
            return y * self.weight if self.weight is not None else y

    if not hasattr(torch.nn, "RMSNorm"):
        torch.nn.RMSNorm = RMSNorm

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        assert dropout_p == 0.0 and not is_causal
        scale = scale if scale is not None else 1.0 / (query.shape[-1] ** 0.5)
        scores = query @ key.transpose(-2, -1) * scale
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                scores = scores.masked_fill(~attn_mask, float("-inf"))
            else:
                scores = scores + attn_mask
        weights = torch.softmax(scores, dim=-1)
        weights = torch.nan_to_num(weights, nan=0.0)  # safe softmax: a row with no key attends to nothing
        return weights @ value

    if not hasattr(torch.nn.functional, "scaled_dot_product_attention"):
        torch.nn.functional.scaled_dot_product_attention = sdpa


def write_stub_packages(root):
    """Importable stand-ins (with dist metadata, which diffusers' import checks read) for what diffusers imports
    from packages Debian 12 does not have; nothing of them is called on this path."""
    body = ("class _Any:\n    def __init__(self, *a, **k): pass\n    def __call__(self, *a, **k): return None\n"
            "def __getattr__(name):\n    if name.startswith('__'): raise AttributeError(name)\n    return _Any\n")
    files = {
        "huggingface_hub/__init__.py": "__version__ = '0.30.0'\n" + body,
        "huggingface_hub/constants.py": "HF_HOME = %r\nHUGGINGFACE_HUB_CACHE = HF_HUB_CACHE = %r\n"
                                        "HF_HUB_OFFLINE = True\nHF_HUB_DISABLE_TELEMETRY = True\n"
                                        "ENDPOINT = 'http://localhost'\n" % (root + "/hf", root + "/hf/hub"),
        "safetensors/__init__.py": body, "safetensors/torch.py": body,
        "transformers/__init__.py": "__version__ = '4.48.0'\n" + body,
    }
    for sub in ["utils", "file_download", "hf_api", "errors", "repocard", "repocard_data", "serialization"]:
        files["huggingface_hub/%s.py" % sub] = body
    for sub in ["utils", "modeling_utils", "tokenization_utils_base"]:
        files["transformers/%s.py" % sub] = body
    for name, version in [("transformers", "4.48.0"), ("huggingface_hub", "0.30.0")]:
        files["%s-%s.dist-info/METADATA" % (name, version)] = "Metadata-Version: 2.1\nName: %s\nVersion: %s\n" % (
            name, version)
        files["%s-%s.dist-info/top_level.txt" % (name, version)] = name + "\n"
    for path, text in files.items():
        full = os.path.join(root, path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "w") as f:
            f.write(text)


def lazy_package(name, path):
    """A package without running its __init__ (whose eager imports need a newer torch): names resolve on use."""
    text = open(os.path.join(path, "__init__.py")).read()
    where = {}
    for sub, names in re.findall(r"from \.(\w+) import ([^\n]+)", text):
        for n in names.split(","):
            where[n.strip()] = sub
    module = types.ModuleType(name)
    module.__path__ = [path]

    def resolve(attr):
        if attr in where:
            return getattr(importlib.import_module(name + "." + where[attr]), attr)
        raise AttributeError(attr)

    module.__getattr__ = resolve
    sys.modules[name] = module


def import_diffusers(src):
    python_deps.require()  # what diffusers' import path needs
    pkg_dir = os.path.join(src, "src", "diffusers")
    if not os.path.isdir(pkg_dir):
        pkg_dir = os.path.join(src, "diffusers")
    if not os.path.isdir(pkg_dir):
        sys.exit("--diffusers-src %s: no src/diffusers or diffusers folder (a diffusers source tree)" % src)
    stubs = tempfile.mkdtemp(prefix="skyreels-stubs-")
    write_stub_packages(stubs)
    sys.path.insert(0, stubs)
    polyfill_torch()
    diffusers = types.ModuleType("diffusers")
    diffusers.__path__ = [pkg_dir]
    diffusers.__version__ = "0.40.0.dev0"
    sys.modules["diffusers"] = diffusers
    lazy_package("diffusers.hooks", os.path.join(pkg_dir, "hooks"))
    lazy_package("diffusers.models.transformers", os.path.join(pkg_dir, "models", "transformers"))
    d = types.SimpleNamespace()
    d.pipeline = importlib.import_module("diffusers.pipelines.skyreels_v2.pipeline_skyreels_v2_diffusion_forcing")
    d.transformer = importlib.import_module("diffusers.models.transformers.transformer_skyreels_v2")
    d.unipc = importlib.import_module("diffusers.schedulers.scheduling_unipc_multistep")
    d.hooks = importlib.import_module("diffusers.hooks.hooks")
    d.vae = importlib.import_module("diffusers.models.autoencoders.autoencoder_kl_wan")
    d.fbc = importlib.import_module("diffusers.hooks.first_block_cache")
    d.helpers = importlib.import_module("diffusers.hooks._helpers")
    return d


# ---- safetensors (float32 only) ----------------------------------------------------------------------------------

def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        assert entry["dtype"] == "F32", (name, entry["dtype"])
        b, e = entry["data_offsets"]
        out[name] = torch.from_numpy(np.frombuffer(data[8 + n + b:8 + n + e], dtype="<f4").reshape(entry["shape"]).copy())
    return out


def write_safetensors(path, tensors):
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        raw = tensors[name].detach().to(torch.float32).contiguous().numpy().astype("<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(tensors[name].shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":"))
    text += " " * ((8 - (8 + len(text)) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text.encode())
        for raw in blobs:
            f.write(raw)


def register_skyreels_block(d):
    """The one registry line diffusers lacks for FirstBlockCache-style hooks on SkyReels-V2 (Wan's metadata), as the
    pipeline_df_cache fixtures add it."""
    d.helpers.TransformerBlockRegistry.register(
        model_class=d.transformer.SkyReelsV2TransformerBlock,
        metadata=d.helpers.TransformerBlockMetadata(return_hidden_states_index=0,
                                                    return_encoder_hidden_states_index=None))


def euler_for_df(d=None):
    """diffusers' FlowMatchEulerDiscreteScheduler as the DF pipelines can run it (tests/data/euler/make_cases.py,
    bench/diffusers_pipeline_time.py). The pipelines pass step() the timestep as a 0-dim int64 tensor (t[idx] of the
    .long() step matrix), which the scheduler refuses ("Passing integer indices ..."): it is passed as a float (the
    scheduler only uses it to find its first step index). They call set_timesteps(num_inference_steps) on the
    scheduler and on a deepcopy per frame: an explicit list (`fixed_timesteps`, copied with the object) is handed to
    every call. Nothing of the schedule or the update is changed."""
    module = importlib.import_module("diffusers.schedulers.scheduling_flow_match_euler_discrete")
    base = module.FlowMatchEulerDiscreteScheduler

    class EulerForDF(base):
        fixed_timesteps = None

        def set_timesteps(self, num_inference_steps=None, device=None, **kwargs):
            if self.fixed_timesteps is not None:
                kwargs["timesteps"] = list(self.fixed_timesteps)
            return super().set_timesteps(num_inference_steps, device=device, **kwargs)

        def step(self, model_output, timestep, sample, **kwargs):
            if isinstance(timestep, torch.Tensor) and not timestep.is_floating_point():
                timestep = timestep.to(torch.float32)
            return super().step(model_output, timestep, sample, **kwargs)

    return EulerForDF


def generator_arguments(default_out, description=None):
    """The command line of a fixture generator: --diffusers-src (or $DIFFUSERS_SRC, required) and --out."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--diffusers-src", default=os.environ.get("DIFFUSERS_SRC"))
    parser.add_argument("--out", default=default_out)
    args = parser.parse_args()
    if not args.diffusers_src:
        sys.exit("give --diffusers-src or $DIFFUSERS_SRC: a diffusers source tree (the commit the fixtures name)")
    return args
