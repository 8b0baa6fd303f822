"""Build tiny random-init Hugging Face directories of today's families, each with its own tokenizer and chat
template, for experiments/configs/families.yaml (and the export tests):

  qwen3/   Qwen3ForCausalLM, a byte-level BPE trained on the task corpus, ChatML (<|im_start|> / <|im_end|>)
           with Qwen3's ``enable_thinking`` switch
  gemma3/  Gemma3ForCausalLM (text), a SentencePiece-style (metaspace, byte fallback) BPE, <start_of_turn> /
           <end_of_turn> turns
  phi3/    Phi3ForCausalLM (fused qkv / gate_up, partial rotary), a Phi-3-style tokenizer trained here
           (SentencePiece-style BPE with byte fallback, Phi-3's control tokens and chat template: <|user|> ...
           <|end|> turns), or the real Phi-3-mini tokenizer with ``--phi3-tokenizer DIR``

    python experiments/family_models.py runs/family_models     # then
    mrl train --config experiments/configs/families.yaml --out runs/families

Every directory has config.json, model.safetensors, tokenizer.json, tokenizer_config.json (with the
chat_template) and generation_config.json; transformers loads each (AutoModelForCausalLM / AutoTokenizer).
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from mrl_jax import models
from mrl_jax.tokenization import load_tokenizer, train_tokenizer
from mrl_jax.trainer.run import task_corpus
from mrl_jax.tasks import default_mixture

QWEN3_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else 'user' }}\n"
    "{{ m['content'] }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
PHI3_TEMPLATE = (   # Phi-3-mini's chat template, as released
    "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + "
    "'<|end|>\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}")
PHI3_SPECIALS = ["<s>", "<|endoftext|>", "<|assistant|>", "<|system|>", "<|end|>", "<|user|>"]

# hidden 64, 2 layers: the shapes of the llama policies of the other experiment configs
SHAPES = {
    "qwen3": dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=24),
    "gemma3_text": dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=1, head_dim=32,
                        query_pre_attn_scalar=32, sliding_window=16),
    "phi3": dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                 partial_rotary_factor=0.75),
}


def _trained_tokenizer(kind: str, corpus, specials, bos, eos, pad, template: str, folder: Path, vocab: int = 400):
    """A tokenizer of ``kind`` trained on ``corpus`` plus ``specials`` (control tokens), saved in ``folder``."""
    tok = train_tokenizer(kind, corpus, vocab)
    hf = tok.hf
    hf.add_special_tokens(list(specials))
    folder.mkdir(parents=True, exist_ok=True)
    hf.save(str(folder / "tokenizer.json"))
    conf = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos, "pad_token": pad,
            "chat_template": template}
    (folder / "tokenizer_config.json").write_text(json.dumps(conf, indent=2))
    return {t: hf.token_to_id(t) for t in (bos, eos, pad, *specials) if t is not None}, hf.get_vocab_size(True)


def _save_model(family: str, vocab: int, folder: Path, seed: int, **ids) -> None:
    model = models.tiny_model(family, vocab, seed=seed, **SHAPES[family], **ids)
    models.save_pretrained(model, folder)
    eos = ids.get("eos_token_id")
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": ids.get("bos_token_id"), "eos_token_id": eos, "pad_token_id": ids.get("pad_token_id")}))


def build(out: str | Path, seed: int = 0, phi3_tokenizer: str | Path | None = None) -> dict[str, Path]:
    """Write the three directories under ``out``; returns {name: directory}. ``phi3_tokenizer``: a folder with
    the real Phi-3-mini tokenizer (tokenizer.json + tokenizer_config.json); None = train a Phi-3-style one."""
    out = Path(out)
    corpus = task_corpus(default_mixture(0, num_facts=32))
    dirs = {"qwen3": out / "qwen3", "gemma3": out / "gemma3", "phi3": out / "phi3"}

    ids, vocab = _trained_tokenizer("byte_bpe", corpus, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                    None, "<|im_end|>", "<|endoftext|>", QWEN3_TEMPLATE, dirs["qwen3"])
    _save_model("qwen3", vocab, dirs["qwen3"], seed, eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
                pad_token_id=ids["<|endoftext|>"], bos_token_id=None)

    ids, vocab = _trained_tokenizer("metaspace_bpe", corpus, ["<start_of_turn>", "<end_of_turn>"],
                                    "<bos>", "<eos>", "<pad>", GEMMA_TEMPLATE, dirs["gemma3"])
    _save_model("gemma3_text", vocab, dirs["gemma3"], seed + 1, bos_token_id=ids["<bos>"],
                eos_token_id=[ids["<eos>"], ids["<end_of_turn>"]], pad_token_id=ids["<pad>"])

    if phi3_tokenizer is None:
        ids, vocab = _trained_tokenizer("metaspace_bpe", corpus, PHI3_SPECIALS, "<s>", "<|endoftext|>",
                                        "<|endoftext|>", PHI3_TEMPLATE, dirs["phi3"])
        _save_model("phi3", vocab, dirs["phi3"], seed + 2, bos_token_id=ids["<s>"],
                    eos_token_id=[ids["<|endoftext|>"], ids["<|end|>"]], pad_token_id=ids["<|endoftext|>"])
        return dirs
    phi3_tok = Path(phi3_tokenizer)
    if not (phi3_tok / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{phi3_tok}: no tokenizer.json (--phi3-tokenizer names the folder of the "
                                "Phi-3-mini tokenizer; leave it out to train a Phi-3-style one)")
    dirs["phi3"].mkdir(parents=True, exist_ok=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(phi3_tok / f, dirs["phi3"] / f)
    # the embedding sized to the tokenizer (32011 ids; the released Phi-3 pads it to 32064, ids the sampler
    # would have to mask in a random-init model)
    _save_model("phi3", load_tokenizer(dirs["phi3"]).vocab_size, dirs["phi3"], seed + 2, bos_token_id=1,
                eos_token_id=[32000, 32007], pad_token_id=32000)
    return dirs


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?", default="runs/family_models", help="output directory")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--phi3-tokenizer", default=None, metavar="DIR",
                    help="folder of the real Phi-3-mini tokenizer (default: train a Phi-3-style tokenizer)")
    args = ap.parse_args(argv)
    for name, path in build(args.out, args.seed, args.phi3_tokenizer).items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
