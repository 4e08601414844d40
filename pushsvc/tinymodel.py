"""A tiny random-weight Llama model, made locally, for end-to-end vLLM runs without a model hub.

``family="gemma3"`` makes a Gemma-3 text model instead (``Gemma3ForCausalLM``): layers of
sliding-window attention with a full-attention layer every third, which vLLM's hybrid
KV-cache manager serves with several KV-cache groups (the hybrid KV tests use it).
``family="deepseek_v2"`` makes a dense DeepSeek-V2 (``DeepseekV2ForCausalLM``): multi-head
latent attention, one latent KV row per token shared by the heads (the MLA tests use it).

``ensure_tiny_model(path)`` writes a directory that vLLM (CPU) and HF transformers both load:
``config.json`` (LlamaForCausalLM, bf16), ``model.safetensors`` (seeded random init) and a
byte-level BPE tokenizer trained here by ``tokenizers`` on generated English-ish text, with a
chat template so ``/v1/chat/completions`` works. The same arguments give the same bytes.

CLI: ``python -m pushsvc.tinymodel PATH [--layers N] [--hidden N] ...``
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

FAMILIES = ("llama", "gemma3", "deepseek_v2")
BOS, EOS = "<s>", "</s>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
REQUIRED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                  "tokenizer_config.json", "special_tokens_map.json")

_WORDS = """the of and to in is it that was for on are with as his they be at one have this from
or had by word but what some we can out other were all there when up use your how said an each
she which do their time if will way about many then them write would like so these her long make
thing see him two has look more day could go come did number sound no most people my over know
water than call first who may down side been now find any new work part take get place made live
where after back little only round man year came show every good me give our under name very
through just form sentence great think say help low line differ turn cause much mean before move
right boy old too same tell does set three want air well also play small end put home read hand
port large spell add even land here must big high such follow act why ask men change went light
kind off need house picture try us again animal point mother world near build self earth father
cache block prefill decode token layer memory transfer request engine server model stream queue"""
_ONSETS = "b c d f g h j k l m n p r s t v w z br ch cl dr fl gr pl sh st th tr"
_VOWELS = "a e i o u ai ea ee oo ou"
_CODAS = "n r s t l nd st ng"


def _corpus(seed: int, n_sentences: int = 12000) -> list[str]:
    """English-ish sentences: common words mixed with pseudo-words made of syllables."""
    rng = random.Random(seed)
    words = _WORDS.split()
    onsets, vowels, codas = _ONSETS.split(), _VOWELS.split(), ["", "", *_CODAS.split()]

    def word() -> str:
        n = rng.randint(1, 3)
        parts = (rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas) for _ in range(n))
        return "".join(parts)

    pseudo = sorted({word() for _ in range(3000)})
    vocab = words + pseudo
    weights = [1.0 / (i + 1) ** 0.9 for i in range(len(vocab))]  # Zipf-like frequencies
    out = []
    for _ in range(n_sentences):
        ws = rng.choices(vocab, weights, k=rng.randint(4, 16))
        s = " ".join(ws).capitalize() + rng.choice([".", ".", ".", "?", "!", ","])
        if rng.random() < 0.15:
            s += f" {rng.randint(0, 9999)}"
        out.append(s)
    return out


def _write_tokenizer(out: Path, vocab: int, seed: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.trainers import BpeTrainer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=vocab,
        special_tokens=[BOS, EOS, *ROLE_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    tok.save(str(out / "tokenizer.json"))
    special = {"bos_token": BOS, "eos_token": EOS, "pad_token": EOS,
               "additional_special_tokens": list(ROLE_TOKENS)}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def _model_config(layers: int, hidden: int, heads: int, kv_heads: int, vocab: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hidden, "intermediate_size": 4 * hidden, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": hidden // heads,
        "hidden_act": "silu", "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": False, "vocab_size": vocab,
        "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 1,
        "torch_dtype": "bfloat16", "dtype": "bfloat16", "initializer_range": 0.02,
        "use_cache": True,
    }


def _gemma3_config(layers: int, hidden: int, heads: int, kv_heads: int, vocab: int, window: int) -> dict:
    return {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "hidden_size": hidden, "intermediate_size": 2 * hidden, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": hidden // heads,
        "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": hidden // heads,
        "sliding_window": window,
        "layer_types": ["full_attention" if (n + 1) % 3 == 0 else "sliding_attention" for n in range(layers)],
        "attention_bias": False, "tie_word_embeddings": True, "vocab_size": vocab,
        "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 1,
        "torch_dtype": "bfloat16", "dtype": "bfloat16", "initializer_range": 0.02, "use_cache": True,
    }


def _deepseek_v2_config(layers: int, hidden: int, heads: int, vocab: int) -> dict:
    """Multi-head latent attention, every layer dense (no experts). vLLM CPU's ``CPU_MLA``
    backend needs ``kv_lora_rank + qk_rope_head_dim == 576``."""
    return {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
        "hidden_size": hidden, "intermediate_size": 2 * hidden, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": heads, "hidden_act": "silu",
        "q_lora_rank": None, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 32,
        "v_head_dim": 32, "head_dim": 64, "first_k_dense_replace": layers, "moe_layer_freq": 1,
        "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,  # unused: every layer is dense
        "moe_intermediate_size": hidden, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "attention_bias": False, "tie_word_embeddings": False, "vocab_size": vocab,
        "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 1,
        "torch_dtype": "bfloat16", "dtype": "bfloat16", "initializer_range": 0.02, "use_cache": True,
    }


def _write_hf_weights(out: Path, cfg: dict, seed: int) -> None:
    """Transformers' own random init of the architecture (seeded), saved in bf16; without
    the lm_head where the config ties it to the embeddings (Gemma-3)."""
    import torch
    import transformers
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    config_class = transformers.AutoConfig.for_model(cfg["model_type"]).__class__
    model_class = getattr(transformers, cfg["architectures"][0])
    model = model_class(config_class(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}))
    tied = {"lm_head.weight"} if cfg.get("tie_word_embeddings") else set()
    sd = {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items() if k not in tied}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})


def _write_weights(out: Path, cfg: dict, seed: int) -> None:
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * cfg["initializer_range"]).to(torch.bfloat16)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.bfloat16)

    sd = {"model.embed_tokens.weight": rnd(v, h)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        sd[p + "input_layernorm.weight"] = ones(h)
        sd[p + "post_attention_layernorm.weight"] = ones(h)
        sd[p + "self_attn.q_proj.weight"] = rnd(q, h)
        sd[p + "self_attn.k_proj.weight"] = rnd(kv, h)
        sd[p + "self_attn.v_proj.weight"] = rnd(kv, h)
        sd[p + "self_attn.o_proj.weight"] = rnd(h, q)
        sd[p + "mlp.gate_proj.weight"] = rnd(i, h)
        sd[p + "mlp.up_proj.weight"] = rnd(i, h)
        sd[p + "mlp.down_proj.weight"] = rnd(h, i)
    sd["model.norm.weight"] = ones(h)
    sd["lm_head.weight"] = rnd(v, h)
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})


def _complete(path: Path) -> bool:
    return all((path / f).is_file() for f in REQUIRED_FILES)


def ensure_tiny_model(
    path: str,
    *,
    layers: int = 8,
    hidden: int = 256,
    heads: int = 4,
    kv_heads: int = 4,
    vocab: int = 4096,
    seed: int = 0,
    family: str = "llama",
    window: int = 128,
) -> str:
    """Make the tiny model at ``path`` unless a complete one is there; return ``path``.

    Built in a temporary sibling directory and renamed into place, so an interrupted run leaves
    nothing half-made. An existing complete model whose config differs raises ``ValueError``.
    """
    if hidden % heads or heads % kv_heads:
        raise ValueError("hidden must divide by heads, and heads by kv_heads")
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r} ({', '.join(FAMILIES)})")
    dest = Path(path)
    cfg = (_gemma3_config(layers, hidden, heads, kv_heads, vocab, window) if family == "gemma3"
           else _deepseek_v2_config(layers, hidden, heads, vocab) if family == "deepseek_v2"
           else _model_config(layers, hidden, heads, kv_heads, vocab))

    def check_existing() -> str:
        have = json.loads((dest / "config.json").read_text())
        diff = {k: (have.get(k), v) for k, v in cfg.items() if have.get(k) != v}
        if diff:
            raise ValueError(f"{dest} holds another model (config differs: {diff})")
        return str(dest)

    if _complete(dest):
        return check_existing()
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        gen_cfg = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 1, "do_sample": False}
        (tmp / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2))
        _write_tokenizer(tmp, vocab, seed)
        (_write_weights if family == "llama" else _write_hf_weights)(tmp, cfg, seed)
        for f in tmp.iterdir():  # safetensors writes 0600; mkdtemp makes 0700
            f.chmod(0o644)
        tmp.chmod(0o755)
        try:
            os.rename(tmp, dest)  # replaces an empty directory; fails on a non-empty one
        except OSError:
            if _complete(dest):  # another process won the race
                return check_existing()
            raise FileExistsError(f"{dest} exists and is not a complete tiny model") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(dest)


def main(argv: list[str] | None = None) -> int:
    first_line = __doc__.splitlines()[0]
    ap = argparse.ArgumentParser(prog="python -m pushsvc.tinymodel", description=first_line)
    ap.add_argument("path")
    sizes = {"layers": 8, "hidden": 256, "heads": 4, "kv_heads": 4, "vocab": 4096, "seed": 0}
    for name, default in sizes.items():
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
    ap.add_argument("--family", choices=FAMILIES, default="llama")
    ap.add_argument("--window", type=int, default=128, help="gemma3: sliding window in tokens")
    args = vars(ap.parse_args(argv))
    print(ensure_tiny_model(args.pop("path"), **args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
