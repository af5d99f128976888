"""Tiny random drafters built and saved by the ``dflash`` and ``speculators`` packages (test oracles),
and their block logits for given context features and anchor."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tiny import TINY_FIELDS

MASK = TINY_FIELDS["vocab_size"] - 1  # the MASK of these drafters: the vocabulary's last token


def qwen3_layers(n_layers: int, fields: dict = TINY_FIELDS, **extra):
    """A ``transformers`` Qwen3 config of drafter layers shaped like a tiny Qwen3 target of ``fields``."""
    import transformers

    f = fields
    return transformers.Qwen3Config(
        vocab_size=f["vocab_size"], hidden_size=f["d_model"], intermediate_size=f["mlp_dim"],
        num_hidden_layers=n_layers, num_attention_heads=f["n_heads"], num_key_value_heads=f["n_kv_heads"],
        head_dim=f["head_dim"], rope_theta=f["rope_theta"], rms_norm_eps=f["rms_eps"],
        max_position_embeddings=f["max_positions"], tie_word_embeddings=False, **extra)


def randomise(model, seed: int, skip: tuple[str, ...] = ()) -> None:
    """Matrices std 0.3, vectors 1 ± 0.2 (norm scales), so that logits spread."""
    import torch

    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(s in name for s in skip):
                continue
            p.copy_(torch.randn_like(p) * 0.3 if p.ndim > 1 else 1 + 0.2 * torch.randn_like(p))


def zlab_drafter(path: Path, *, layer_ids=(0, 1), block_size: int = 4, n_layers: int = 2, seed: int = 0,
                 fields: dict = TINY_FIELDS):
    """A z-lab ``DFlashDraftModel`` for the tiny Qwen3 target of ``fields`` (``tiny.TINY_FIELDS``
    form; MASK = its last token), saved with ``save_pretrained``."""
    from dflash.model import DFlashDraftModel

    config = qwen3_layers(n_layers, fields, num_target_layers=fields["n_layers"], block_size=block_size,
                          dflash_config={"mask_token_id": fields["vocab_size"] - 1,
                                         "target_layer_ids": list(layer_ids)})
    config.architectures = ["DFlashDraftModel"]
    model = DFlashDraftModel(config).eval()
    randomise(model, seed)
    model.save_pretrained(path)
    return model


def zlab_logits(model, embed: np.ndarray, head: np.ndarray, features: np.ndarray, anchor: int) -> np.ndarray:
    """z-lab's block logits ``[B − 1, V]`` (slots 1..B−1, as ``dflash_generate`` drafts them) for the
    context ``features [T, m·D]`` at positions ``0..T−1`` and the anchor at position ``T``.

    ``embed [V, D]`` is the target's embedding, ``head [V, D]`` its LM head (PyTorch layout).
    """
    import torch

    t, b = features.shape[0], model.block_size
    block = torch.tensor([[anchor] + [model.mask_token_id] * (b - 1)])
    noise = torch.nn.functional.embedding(block, torch.tensor(embed))
    with torch.no_grad():
        hidden = model(target_hidden=torch.tensor(features)[None], noise_embedding=noise,
                       position_ids=torch.arange(t + b)[None])[:, 1:]
        return model.compute_logits(hidden, lambda h: h @ torch.tensor(head).T)[0].numpy()


def speculators_drafter(path: Path, kind: str, embed: np.ndarray, head: np.ndarray, *, draft_ids=None,
                        sample_from_anchor: bool, block_size: int = 4, seed: int = 0, **dspark):
    """A speculators ``dflash`` / ``dspark`` drafter for the tiny Qwen3 target (layer ids 1, 2 =
    our 0, 1), its verifier-owned weights set from ``embed``/``head`` ``[V, D]``, saved with
    ``save_pretrained``. ``draft_ids``: ascending target ids of a reduced draft vocabulary."""
    import torch
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
    from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    config_cls, model_cls = {"dflash": (DFlashSpeculatorConfig, DFlashDraftModel),
                             "dspark": (DSparkSpeculatorConfig, DSparkDraftModel)}[kind]
    v = embed.shape[0]
    ids = np.arange(v) if draft_ids is None else np.asarray(draft_ids)
    layers = qwen3_layers(2)
    layers._attn_implementation = "eager"
    spec = SpeculatorsConfig(algorithm=kind, proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
                             default_proposal_method="greedy",
                             verifier=VerifierConfig(name_or_path=None, architectures=["Qwen3ForCausalLM"]))
    config = config_cls(transformer_layer_config=layers, draft_vocab_size=len(ids), block_size=block_size,
                        aux_hidden_state_layer_ids=[1, 2], mask_token_id=MASK, sample_from_anchor=sample_from_anchor,
                        speculators_config=spec, **dspark)
    model = model_cls(config).eval()
    if draft_ids is not None:
        t2d = torch.zeros(v, dtype=torch.bool)
        t2d[torch.tensor(ids)] = True
        model.load_vocab_mappings(t2d, torch.tensor(ids - np.arange(len(ids))))
    randomise(model, seed, skip=("embed_tokens", "lm_head", "verifier_"))
    with torch.no_grad():
        model.embed_tokens.weight.copy_(torch.tensor(embed))
        for linear in (model.lm_head, model.verifier_lm_head):
            linear.weight.copy_(torch.tensor(head[ids]))
    model.save_pretrained(path)
    return model


def speculators_logits(model, features: np.ndarray, tokens: np.ndarray, anchor: int):
    """speculators' block logits for the anchor at position ``anchor`` (context = features of the
    positions before it), from its training forward with one anchor block.

    Returns:
      ``(logits [depths, U], confidence [depths] or None)``: the drafted slots (all ``B`` with
      ``sample_from_anchor``, else ``1..B−1``), DSpark's Markov bias added with the gold previous
      tokens ``tokens[anchor + k]`` as in its training, which also feed the confidence head's Markov
      embedding with ``confidence_head_with_markov``.
    """
    import torch

    t = len(tokens)
    mask = torch.zeros(1, t)
    mask[0, anchor] = 1
    args = dict(hidden_states=torch.tensor(features)[None], input_ids=torch.tensor(tokens)[None], loss_mask=mask,
                verifier_last_hidden_states=torch.zeros(1, t, features.shape[1] // 2),
                document_ids=torch.zeros(1, t, dtype=torch.long), max_anchors=1)
    b = model.block_size
    with torch.no_grad():
        hidden, logits, *_ = model._backbone_forward(**args)
        confidence = None
        if getattr(model, "markov_head", None) is not None:
            prev = torch.tensor(tokens[anchor:anchor + b])[None]
            logits = logits + model.markov_head.block_bias(prev_token_ids=prev, hidden_states=hidden)
        if getattr(model, "confidence_head", None) is not None:
            with_markov = model.config.confidence_head_with_markov
            inputs = torch.cat([hidden, model.markov_head.prev_embeddings(prev)], -1) if with_markov else hidden
            confidence = model.confidence_head(inputs)[0].numpy()
    first = 0 if model.config.sample_from_anchor else 1
    return logits[0, first:].numpy(), None if confidence is None else confidence[first:]
