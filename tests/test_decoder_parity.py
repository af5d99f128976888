"""Our decoder against Hugging Face ``transformers`` on tiny random Llama / Qwen2 / Qwen3 models."""

import jax.numpy as jnp
import numpy as np
import pytest

from treespark_jax.decode.ar import decode_mask
from treespark_jax.decode.prefill import prefill_mask
from treespark_jax.models.decoder import Decoder
from treespark_jax.models.kv_cache import KVCache
from treespark_jax.models.load_hf import load_hf_config, load_hf_weights

from tiny import hf_model

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.parity

PROMPT_LEN, DECODE_STEPS, CAPACITY = 11, 8, 32


def log_softmax(x):
    x = np.asarray(x, np.float64)
    return x - np.log(np.sum(np.exp(x - x.max(-1, keepdims=True)), -1, keepdims=True)) - x.max(-1, keepdims=True)


def relative_error(ours, ref):
    """Largest elementwise |a − b| / max(|b|, 1) between log-probabilities."""
    a, b = log_softmax(ours), log_softmax(ref)
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1.0)))


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_prefill_and_cached_decode_match_transformers(family, tmp_path):
    hf = hf_model(family)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    cfg = load_hf_config(tmp_path)
    model = Decoder(cfg, load_hf_weights(tmp_path, cfg), jnp.float32)
    assert cfg.head_dim != cfg.d_model // cfg.n_heads and cfg.n_kv_heads < cfg.n_heads

    prompt = np.random.default_rng(1).integers(0, cfg.vocab_size, (1, PROMPT_LEN))
    with torch.no_grad():
        out = hf(torch.tensor(prompt), use_cache=True)
    ref_logits, past = out.logits.numpy()[0], out.past_key_values
    assert ref_logits.std() > 1.0, "weights too small: logits do not spread"

    cache = KVCache.zeros(cfg, 1, CAPACITY)
    lens = jnp.asarray([PROMPT_LEN])
    res = model(jnp.asarray(prompt), jnp.arange(PROMPT_LEN)[None], prefill_mask(lens, PROMPT_LEN, CAPACITY), cache)
    assert relative_error(model.logits(res.hidden)[0], ref_logits) < 1e-4
    cache = res.cache.replace(lengths=lens)

    token = int(ref_logits[-1].argmax())
    for _ in range(DECODE_STEPS):
        with torch.no_grad():
            out = hf(torch.tensor([[token]]), past_key_values=past, use_cache=True)
        ref, past = out.logits.numpy()[0, -1], out.past_key_values
        res = model(jnp.asarray([[token]]), cache.lengths[:, None], decode_mask(cache.lengths, CAPACITY), cache)
        assert relative_error(model.logits(res.hidden)[0, -1], ref) < 1e-4
        cache = res.cache.replace(lengths=cache.lengths + 1)
        token = int(ref.argmax())
