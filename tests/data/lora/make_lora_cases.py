#!/usr/bin/env python3
"""Builds the LoRA fixtures of tests/test_lora.cpp from diffusers' own conversion functions.

For the tiny golden model transformer_forward/t1_tiny_df_fps (inner dim 24, 2 blocks) it writes random rank-4
adapters in the three key formats SkyReelsV2LoraLoaderMixin.lora_state_dict accepts:
  diffusers_format.safetensors  transformer.<module>.lora_A/lora_B.weight, some .alpha, one lora_B.bias
  original_format.safetensors   diffusion_model.<original module>.lora_down/lora_up.weight, .alpha, .diff_b, and a
                                norm .diff key diffusers drops
  musubi_format.safetensors     lora_unet_blocks_<N>_<module>.lora_down/lora_up.weight, .alpha (every module)
The original and musubi adapters are converted by diffusers' _convert_non_diffusers_wan_lora_to_diffusers and
_convert_musubi_wan_lora_to_diffusers (loaded from the diffusers source tree; alpha / rank is folded into A and B
there), the diffusers-format one is used as is with PEFT's scaling alpha / r (alpha = r when absent). Each is merged
into the base weights in float64 as PEFT merges: W + scale * (alpha / r) * B @ A, bias + scale * (alpha / r) * b
(alpha / r = 1 after diffusers' folding), and every changed parameter is written in float32 to
expected_<case>.safetensors. expected_stack.safetensors holds original (scale 0.7) then musubi (scale -0.5) merged.

usage: DIFFUSERS_SRC=/path/to/diffusers python3 make_lora_cases.py [--diffusers-src PATH] [--out DIR]
(/usr/bin/python3 with Debian's python3-torch; no diffusers install, no safetensors package needed.)
"""
import importlib.util
import logging
import os
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "scripts"))
from diffusers_env import generator_arguments, read_safetensors, write_safetensors  # noqa: E402
import torch  # noqa: E402  (after diffusers_env, which names a missing package in its first line)
BASE = os.path.join(HERE, "..", "golden", "transformer_forward", "t1_tiny_df_fps", "weights", "diffusers",
                    "diffusion_pytorch_model.safetensors")
RANK = 4

# ---- diffusers' conversion functions, from its source -------------------------------------------------------------

def load_conversion_utils(src):
    """Loads src/diffusers/loaders/lora_conversion_utils.py with stubs for the only names it imports."""
    path = os.path.join(src, "src", "diffusers", "loaders", "lora_conversion_utils.py")
    if not os.path.exists(path):
        path = os.path.join(src, "diffusers", "loaders", "lora_conversion_utils.py")
    pkg = types.ModuleType("diffusers_stub")
    pkg.__path__ = []
    utils = types.ModuleType("diffusers_stub.utils")
    utils.logging = types.SimpleNamespace(get_logger=logging.getLogger)
    utils.state_dict_all_zero = lambda sd, filter_str=None: all(torch.all(v == 0) for v in sd.values())
    loaders = types.ModuleType("diffusers_stub.loaders")
    loaders.__path__ = []
    sys.modules.update({"diffusers_stub": pkg, "diffusers_stub.utils": utils, "diffusers_stub.loaders": loaders})
    spec = importlib.util.spec_from_file_location("diffusers_stub.loaders.lora_conversion_utils", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- adapters -----------------------------------------------------------------------------------------------------

BLOCK_MODULES = [  # (original, musubi, diffusers)
    ("self_attn.q", "self_attn_q", "attn1.to_q"), ("self_attn.k", "self_attn_k", "attn1.to_k"),
    ("self_attn.v", "self_attn_v", "attn1.to_v"), ("self_attn.o", "self_attn_o", "attn1.to_out.0"),
    ("cross_attn.q", "cross_attn_q", "attn2.to_q"), ("cross_attn.k", "cross_attn_k", "attn2.to_k"),
    ("cross_attn.v", "cross_attn_v", "attn2.to_v"), ("cross_attn.o", "cross_attn_o", "attn2.to_out.0"),
    ("ffn.0", "ffn_0", "ffn.net.0.proj"), ("ffn.2", "ffn_2", "ffn.net.2"),
]


def ab(base, module, gen):
    out_f, in_f = base[module + ".weight"].shape
    a = torch.randn(RANK, in_f, generator=gen) * 0.3
    b = torch.randn(out_f, RANK, generator=gen) * 0.3
    return a, b


def merge(base, converted, scale, alphas=None, merged=None):
    """PEFT's merge of a diffusers-format state dict (transformer.<module>.lora_A/B...), in float64."""
    merged = dict(merged or {})
    alphas = alphas or {}
    for key, a in converted.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module = key[len("transformer."):-len(".lora_A.weight")]
        b = converted["transformer." + module + ".lora_B.weight"]
        r = a.shape[0]
        factor = scale * alphas.get(module, r) / r
        w = merged.get(module + ".weight", base[module + ".weight"]).double()
        merged[module + ".weight"] = w + factor * (b.double() @ a.double())
        bias_key = "transformer." + module + ".lora_B.bias"
        if bias_key in converted:
            bias = merged.get(module + ".bias", base[module + ".bias"]).double()
            merged[module + ".bias"] = bias + factor * converted[bias_key].double()
    return merged


def diffusers_adapter(base, gen):
    sd, alphas = {}, {}
    for i in range(2):
        for _, _, d in BLOCK_MODULES:
            m = f"blocks.{i}.{d}"
            a, b = ab(base, m, gen)
            sd[f"transformer.{m}.lora_A.weight"] = a
            sd[f"transformer.{m}.lora_B.weight"] = b
            if "attn2" in d:  # alpha on the cross-attention only; elsewhere alpha = r
                alphas[m] = 8.0
                sd[f"transformer.{m}.alpha"] = torch.tensor(8.0)
    a, b = ab(base, "proj_out", gen)
    sd["transformer.proj_out.lora_A.weight"] = a
    sd["transformer.proj_out.lora_B.weight"] = b
    sd["transformer.proj_out.lora_B.bias"] = torch.randn(b.shape[0], generator=gen) * 0.1
    return sd, alphas


def original_adapter(base, gen):
    sd = {}
    for i in range(2):
        for o, _, d in BLOCK_MODULES:
            a, b = ab(base, f"blocks.{i}.{d}", gen)
            sd[f"diffusion_model.blocks.{i}.{o}.lora_down.weight"] = a
            sd[f"diffusion_model.blocks.{i}.{o}.lora_up.weight"] = b
            sd[f"diffusion_model.blocks.{i}.{o}.alpha"] = torch.tensor(2.0 if o.startswith("self") else 16.0)
        sd[f"diffusion_model.blocks.{i}.ffn.2.diff_b"] = torch.randn(24, generator=gen) * 0.1
        sd[f"diffusion_model.blocks.{i}.norm3.diff"] = torch.zeros(24)  # diffusers drops norm diffs
    for o, d in [("head.head", "proj_out"), ("text_embedding.0", "condition_embedder.text_embedder.linear_1")]:
        a, b = ab(base, d, gen)
        sd[f"diffusion_model.{o}.lora_down.weight"] = a
        sd[f"diffusion_model.{o}.lora_up.weight"] = b
    return sd


def musubi_adapter(base, gen):
    sd = {}
    for i in range(2):
        for _, u, d in BLOCK_MODULES:
            a, b = ab(base, f"blocks.{i}.{d}", gen)
            sd[f"lora_unet_blocks_{i}_{u}.lora_down.weight"] = a
            sd[f"lora_unet_blocks_{i}_{u}.lora_up.weight"] = b
            sd[f"lora_unet_blocks_{i}_{u}.alpha"] = torch.tensor(1.0)  # alpha / r = 1/4
    return sd


def main():
    args = generator_arguments(HERE)
    conv = load_conversion_utils(args.diffusers_src)
    base = read_safetensors(BASE)
    gen = torch.Generator().manual_seed(23)

    dif, dif_alphas = diffusers_adapter(base, gen)
    orig = original_adapter(base, gen)
    mus = musubi_adapter(base, gen)
    # Copies: the converters scale some tensors in place (`*=`), which must not reach the adapter files.
    orig_converted = conv._convert_non_diffusers_wan_lora_to_diffusers({k: v.clone() for k, v in orig.items()})
    mus_converted = conv._convert_musubi_wan_lora_to_diffusers({k: v.clone() for k, v in mus.items()})

    cases = {
        "diffusers_format": (dif, merge(base, dif, 1.0, dif_alphas)),
        "original_format": (orig, merge(base, orig_converted, 1.0)),
        "musubi_format": (mus, merge(base, mus_converted, 1.0)),
    }
    for name, (adapter, merged) in cases.items():
        write_safetensors(os.path.join(args.out, name + ".safetensors"), adapter)
        write_safetensors(os.path.join(args.out, "expected_" + name + ".safetensors"), merged)
    stack = merge(base, mus_converted, -0.5, merged=merge(base, orig_converted, 0.7))
    write_safetensors(os.path.join(args.out, "expected_stack.safetensors"), stack)
    for name in sorted(os.listdir(args.out)):
        if name.endswith(".safetensors"):
            print(f"{name}: {os.path.getsize(os.path.join(args.out, name))} bytes")


if __name__ == "__main__":
    main()
