"""Tiny random-weight Llama (and MLA) models and deterministic prompts, for tests
without a model hub.

:func:`build_model` writes a Hugging Face model directory (random float32 weights plus a
tokenizer trained locally) that vLLM and transformers load offline; the same
:class:`ModelSpec` always gives byte-identical files. :func:`make_prompt_token_ids` and
:func:`shared_prefix_prompts` give reproducible token-id prompts for such a model.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")
"""Special tokens, in id order: unk 0, bos 1, eos 2, pad 3."""
NUM_SPECIAL_TOKENS = len(SPECIAL_TOKENS)
"""Token ids below this are special; prompts built here never contain them."""

_BUILD_VERSION = 2  # Bump when the build procedure changes, so cached models are rebuilt.
_COMPLETE_MARKER = "ucm-model-spec.json"
_CORPUS_WORDS = 40_000
_GAINS = {"q_proj": 3.0, "k_proj": 3.0, "v_proj": 2.0, "o_proj": 2.0}


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Shape and seed of a random-weight Llama-style model."""

    hidden_size: int
    """Width of the residual stream."""
    num_layers: int
    """Number of decoder layers."""
    num_heads: int
    """Number of attention (query) heads."""
    num_kv_heads: int
    """Number of key/value heads (grouped-query attention when below ``num_heads``)."""
    head_dim: int | None = None
    """Width of one attention head; ``None`` means ``hidden_size // num_heads``."""
    intermediate_size: int
    """Width of the MLP's hidden layer."""
    vocab_size: int
    """Number of token ids, for the model and the tokenizer alike."""
    max_position_embeddings: int
    """Longest sequence the model accepts."""
    seed: int = 0
    """Seed of the weights and of the tokenizer's training text."""
    kv_lora_rank: int | None = None
    """Set: a DeepSeek-V2-style model with multi-head latent attention (MLA), whose KV
    cache holds one latent vector of this width (plus the rotary part) per token."""

    @property
    def name(self) -> str:
        """Directory name under a models root, derived from a hash of the spec."""
        blob = json.dumps([_BUILD_VERSION, dataclasses.asdict(self)], sort_keys=True)
        kind = "llama" if self.kv_lora_rank is None else "mla"
        return (
            f"{kind}-h{self.hidden_size}-l{self.num_layers}-"
            + hashlib.sha256(blob.encode()).hexdigest()[:12]
        )


TINY = ModelSpec(
    hidden_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=384,
    vocab_size=2048,
    max_position_embeddings=4096,
)
"""About 0.9 M parameters (3.7 MB on disk): the default for tests."""
SMALL = ModelSpec(
    hidden_size=256,
    num_layers=4,
    num_heads=8,
    num_kv_heads=4,
    intermediate_size=768,
    vocab_size=4096,
    max_position_embeddings=4096,
)
"""About 5.2 M parameters (21 MB on disk): more layers and heads per block of KV."""
MEDIUM = ModelSpec(
    hidden_size=512,
    num_layers=8,
    num_heads=8,
    num_kv_heads=4,
    intermediate_size=1536,
    vocab_size=8192,
    max_position_embeddings=8192,
)
"""About 30M parameters: prefill dominates on a CPU with 2k-token prompts."""
LARGE = ModelSpec(
    hidden_size=768,
    num_layers=12,
    num_heads=12,
    num_kv_heads=4,
    intermediate_size=3072,
    vocab_size=8192,
    max_position_embeddings=8192,
)
"""About 110M parameters, for 4-8k-token prompts (slow on 2 cores)."""
KV_HEAVY = ModelSpec(
    hidden_size=512,
    num_layers=4,
    num_heads=8,
    num_kv_heads=8,
    head_dim=256,
    intermediate_size=512,
    vocab_size=8192,
    max_position_embeddings=8192,
)
"""Many wide KV heads and a thin MLP: ~64 KiB of KV per token for ~60 MFLOP, about 150x
the KV bytes per prefill FLOP of a Llama-3-8B, so storage I/O weighs on a CPU about as
much as it does for a large model on a GPU."""


TINY_MLA = ModelSpec(
    hidden_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=4,
    head_dim=128,  # Rotary part 64: with the latent, the 576 vLLM's CPU MLA kernel takes.
    intermediate_size=384,
    vocab_size=2048,
    max_position_embeddings=4096,
    kv_lora_rank=512,
)
"""A tiny DeepSeek-V2-style model with MLA (dense MLPs): every tensor-parallel rank
holds the same latent KV."""


def build_model(spec: ModelSpec, root: Path) -> Path:
    """Builds the model for ``spec`` under ``root``, or reuses one already built there.

    The model is built in a temporary directory inside ``root`` and renamed into place, so
    a directory at the returned path is always complete, and concurrent builders (threads
    or processes) all end up with the same directory.

    Args:
        spec: Shape and seed of the model.
        root: Directory holding built models; created if missing.

    Returns:
        The model directory ``root / spec.name``, loadable by vLLM and transformers.
    """
    target = root / spec.name
    if (target / _COMPLETE_MARKER).is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{spec.name}.", dir=root))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the model should read like any directory.
        _write_model(spec, tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / _COMPLETE_MARKER).is_file():
                raise  # Not a lost race: something else occupies the target.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _write_model(spec: ModelSpec, out: Path) -> None:
    model = _llama(spec) if spec.kv_lora_rank is None else _deepseek_v2(spec)
    # Unit-variance embeddings and 1/sqrt(fan_in) projections keep the residual stream's scale
    # (std 0.02 makes greedy output loop). Larger query/key gains sharpen attention and larger
    # value/output gains weigh what it reads, so outputs depend on early KV, not just the last
    # token: changing one token in the first half of a 256-token prompt changes the output.
    generator = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
            if param.ndim == 1:
                param.fill_(1.0)
                continue
            kind = name.rsplit(".", 2)[-2]
            std = 1.0 if kind == "embed_tokens" else _GAINS.get(kind, 1.0) * param.shape[1] ** -0.5
            param.normal_(0.0, std, generator=generator)
    model.save_pretrained(out)
    _train_tokenizer(spec).save_pretrained(out)
    spec_json = json.dumps(dataclasses.asdict(spec), indent=2, sort_keys=True)
    (out / _COMPLETE_MARKER).write_text(spec_json + "\n")


def _special_ids() -> dict[str, Any]:
    return {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3, "tie_word_embeddings": False}


def _deepseek_v2(spec: ModelSpec) -> PreTrainedModel:
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    head = spec.head_dim or spec.hidden_size // spec.num_heads
    config = DeepseekV2Config(
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        intermediate_size=spec.intermediate_size,
        moe_intermediate_size=spec.intermediate_size,
        first_k_dense_replace=spec.num_layers,  # Dense MLPs only.
        kv_lora_rank=spec.kv_lora_rank,
        q_lora_rank=None,
        qk_rope_head_dim=head // 2,
        qk_nope_head_dim=head // 2,
        v_head_dim=head,
        vocab_size=spec.vocab_size,
        max_position_embeddings=spec.max_position_embeddings,
        dtype="float32",
        **_special_ids(),
    )
    return DeepseekV2ForCausalLM(config)


def _llama(spec: ModelSpec) -> PreTrainedModel:
    config = LlamaConfig(
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim or spec.hidden_size // spec.num_heads,
        intermediate_size=spec.intermediate_size,
        vocab_size=spec.vocab_size,
        max_position_embeddings=spec.max_position_embeddings,
        dtype="float32",
        **_special_ids(),
    )
    return LlamaForCausalLM(config)


def _train_tokenizer(spec: ModelSpec) -> PreTrainedTokenizerFast:
    """Trains a byte-level BPE tokenizer of exactly ``spec.vocab_size`` tokens."""
    tokenizer = Tokenizer(models.BPE(unk_token=SPECIAL_TOKENS[0]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(spec.seed), trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 1)]
    )
    got = tokenizer.get_vocab_size()
    if got != spec.vocab_size:
        raise ValueError(f"tokenizer has {got} tokens, the spec asks for {spec.vocab_size}")
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token=SPECIAL_TOKENS[0],
        bos_token=SPECIAL_TOKENS[1],
        eos_token=SPECIAL_TOKENS[2],
        pad_token=SPECIAL_TOKENS[3],
        model_max_length=spec.max_position_embeddings,
    )


def _corpus(seed: int) -> list[str]:
    """Deterministic text: sentences of pseudo-words with Zipf-like word frequencies."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    lexicon = ["".join(rng.choices(letters, k=rng.randint(1, 9))) for _ in range(5000)]
    weights = [1.0 / (rank + 1) for rank in range(len(lexicon))]
    words = rng.choices(lexicon, weights=weights, k=_CORPUS_WORDS)
    return [" ".join(words[i : i + 20]).capitalize() + "." for i in range(0, len(words), 20)]


def make_prompt_token_ids(num_tokens: int, seed: int, vocab_size: int) -> list[int]:
    """Returns ``num_tokens`` pseudo-random token ids, none of them special.

    Args:
        num_tokens: Length of the prompt.
        seed: Same seed, same prompt.
        vocab_size: Ids are drawn from ``[NUM_SPECIAL_TOKENS, vocab_size)``.

    Returns:
        The token ids.
    """
    return _draw(random.Random(seed), num_tokens, vocab_size)


def shared_prefix_prompts(
    prefix_len: int, suffix_len: int, n: int, seed: int, vocab_size: int
) -> list[list[int]]:
    """Returns ``n`` prompts that share their first ``prefix_len`` tokens, then differ.

    The shared prefix equals ``make_prompt_token_ids(prefix_len, seed, vocab_size)``, and the
    first suffix token differs between every two prompts.

    Args:
        prefix_len: Length of the shared prefix.
        suffix_len: Length of each prompt's own suffix, at least 1.
        n: Number of prompts.
        seed: Same seed, same prompts.
        vocab_size: Ids are drawn from ``[NUM_SPECIAL_TOKENS, vocab_size)``.

    Returns:
        The prompts, each ``prefix_len + suffix_len`` token ids long.

    Raises:
        ValueError: ``suffix_len`` is below 1.
    """
    if suffix_len < 1:
        raise ValueError(f"prompts need suffix_len >= 1 to differ, got {suffix_len}")
    rng = random.Random(seed)
    prefix = _draw(rng, prefix_len, vocab_size)
    firsts = rng.sample(range(NUM_SPECIAL_TOKENS, vocab_size), n)
    return [[*prefix, first, *_draw(rng, suffix_len - 1, vocab_size)] for first in firsts]


def _draw(rng: random.Random, num_tokens: int, vocab_size: int) -> list[int]:
    return [rng.randrange(NUM_SPECIAL_TOKENS, vocab_size) for _ in range(num_tokens)]
