"""A transformers KV cache in a jitted model's result, and passed back (capture/kv_cache.py)."""

from __future__ import annotations

import pytest
import torch

import partita
from partita import Mesh
from partita.capture.trace import trace
from partita.errors import CaptureError
from partita.values.tensor import ShardedTensor

transformers = pytest.importorskip("transformers")


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()


def test_the_default_call_returns_the_cache_sharded_and_a_decode_loop_equals_eager() -> None:
    """Eval mode returns a DynamicCache unless use_cache=False; feeding it back decodes."""
    model = _llama()
    mesh = Mesh.create((2, 2), ("data", "model"))
    fwd = partita.jit(model, mesh=mesh, param_specs="fsdp+tp")
    ids = torch.randint(0, 48, (4, 6))
    out = fwd(input_ids=ids)
    with torch.no_grad():
        ref = model(input_ids=ids)
    for _ in range(2):
        cache = out.past_key_values
        assert type(cache) is type(ref.past_key_values)
        assert cache.get_seq_length() == ref.past_key_values.get_seq_length()
        keys = cache.layers[0].keys
        assert isinstance(keys, ShardedTensor)
        torch.testing.assert_close(keys.full(), ref.past_key_values.layers[0].keys)
        torch.testing.assert_close(out.logits.full(), ref.logits, rtol=1e-5, atol=1e-5)
        token = ref.logits[:, -1].argmax(-1, keepdim=True)
        assert torch.equal(out.logits.full()[:, -1].argmax(-1, keepdim=True), token)
        out = fwd(input_ids=token, past_key_values=cache)
        with torch.no_grad():
            ref = model(input_ids=token, past_key_values=ref.past_key_values)
    torch.testing.assert_close(out.logits.full(), ref.logits, rtol=1e-5, atol=1e-5)


def test_an_encoder_decoder_cache_comes_back_whole() -> None:
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=48, d_model=32, d_ff=64, num_layers=1,
                                   num_heads=4, d_kv=8)  # fmt: skip
    model = transformers.T5ForConditionalGeneration(config).eval()
    fwd = partita.jit(model, mesh=Mesh.create((2,), ("data",)), param_specs="fsdp")
    ids = torch.randint(0, 48, (2, 5))
    out = fwd(input_ids=ids, decoder_input_ids=ids[:, :3])
    with torch.no_grad():
        ref = model(input_ids=ids, decoder_input_ids=ids[:, :3])
    cache = out.past_key_values
    assert type(cache).__name__ == "EncoderDecoderCache"
    torch.testing.assert_close(
        cache.cross_attention_cache.layers[0].values.full(),
        ref.past_key_values.cross_attention_cache.layers[0].values,
    )
    torch.testing.assert_close(out.logits.full(), ref.logits, rtol=1e-5, atol=1e-5)


def test_a_cache_that_cannot_be_rebuilt_says_use_cache_false() -> None:
    class SlottedCache:  # stands for a cache object pytree cannot take apart
        __module__ = "transformers.cache_utils"
        __slots__ = ("keys",)

        def __init__(self) -> None:
            self.keys = torch.ones(2)

    cache = SlottedCache()
    with pytest.raises(CaptureError, match=r"returned SlottedCache .*a transformers KV cache, "
                       r"returned by default: call the model with use_cache=False"):  # fmt: skip
        trace(lambda a: {"logits": a, "past_key_values": cache}, (torch.ones(2),))


def test_an_empty_cache_passed_in_comes_back_filled() -> None:
    """The model grows a cache it was given (layers appended while traced): the result holds
    what it holds now, not the empty structure it came in with."""
    model = _llama()
    fwd = partita.jit(model, mesh=Mesh.create((2,), ("data",)), param_specs="fsdp")
    ids = torch.randint(0, 48, (2, 5))
    out = fwd(input_ids=ids, past_key_values=transformers.DynamicCache())
    with torch.no_grad():
        ref = model(input_ids=ids, past_key_values=transformers.DynamicCache())
    assert out.past_key_values.get_seq_length() == 5 == ref.past_key_values.get_seq_length()
    torch.testing.assert_close(
        out.past_key_values.layers[1].values.full(), ref.past_key_values.layers[1].values
    )
