"""Parity with transformers' LlamaForCausalLM, component by component, with the same weights."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from model import MiniMindConfig, MiniMindForCausalLM
from model.rope import Rope, apply_rope, apply_rope_rolled, rolled_sin, rope_cos_sin

TOLERANCE = 1e-4


def build_pair(num_kv_heads):
    torch.manual_seed(0)
    config = MiniMindConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=num_kv_heads, vocab_size=300
    )
    ours = MiniMindForCausalLM(config).eval()
    return ours, llama_twin(ours)


def llama_twin(ours):
    """transformers' LlamaForCausalLM (SDPA) with the weights of the dense MiniMind model `ours`."""
    config = ours.config
    reference_config = LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        tie_word_embeddings=True,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    reference_config._attn_implementation = "sdpa"
    reference = LlamaForCausalLM(reference_config).eval()
    missing, unexpected = reference.load_state_dict(ours.state_dict(), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    reference.tie_weights()
    assert torch.equal(reference.lm_head.weight, ours.lm_head.weight)
    return reference


@pytest.fixture(params=[4, 2, 1], ids=["mha", "gqa", "mqa"])
def pair(request):
    return build_pair(request.param)


def max_diff(a, b):
    return (a - b).abs().max().item()


def test_rmsnorm_rope_mlp(pair):
    ours, reference = pair
    x = torch.randn(2, 11, 64)
    assert max_diff(ours.model.norm(x), reference.model.norm(x)) <= TOLERANCE
    assert max_diff(ours.model.layers[0].mlp(x), reference.model.layers[0].mlp(x)) <= TOLERANCE
    positions = torch.arange(11)[None].expand(2, 11)
    cos, sin = rope_cos_sin(positions, ours.config.head_dim, ours.config.rope_theta, torch.float32)
    ref_cos, ref_sin = reference.model.rotary_emb(x, positions)
    assert max_diff(cos[:, 0], ref_cos) <= TOLERANCE and max_diff(sin[:, 0], ref_sin) <= TOLERANCE


@pytest.mark.parametrize("head_dim", [2, 16, 64])
def test_rolled_rope_equals_llamas_rotation(head_dim):
    """The decode path's three-kernel rotation (apply_rope_rolled) against transformers' own."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 9, head_dim), torch.randn(2, 2, 9, head_dim)
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8], [100, 7, 3, 5000, 1, 2, 64, 65, 9]])
    cos, sin = rope_cos_sin(positions, head_dim, 1e4, torch.float32)
    ref_q, ref_k = apply_rotary_pos_emb(q, k, cos[:, 0], sin[:, 0])
    assert max_diff(apply_rope_rolled(q, cos, rolled_sin(sin)), ref_q) <= TOLERANCE
    assert max_diff(apply_rope_rolled(k, cos, rolled_sin(sin)), ref_k) <= TOLERANCE
    assert max_diff(apply_rope(k, cos, sin), ref_k) <= TOLERANCE


def test_attention_and_block(pair):
    ours, reference = pair
    x = torch.randn(2, 13, 64)
    positions = torch.arange(13)[None].expand(2, 13)
    rope = Rope(positions, ours.config.head_dim, ours.config.rope_theta, torch.float32)
    ref_rope = reference.model.rotary_emb(x, positions)
    ours_attention = ours.model.layers[0].self_attn(x, rope, None, None, None)
    ref_attention, _ = reference.model.layers[0].self_attn(x, position_embeddings=ref_rope, attention_mask=None)
    assert max_diff(ours_attention, ref_attention) <= TOLERANCE
    ours_block = ours.model.layers[0](x, rope, None, None, None)
    ref_block = reference.model.layers[0](x, attention_mask=None, position_embeddings=ref_rope)
    assert max_diff(ours_block, ref_block) <= TOLERANCE


def test_full_model_logits_and_greedy_generation(pair):
    ours, reference = pair
    input_ids = torch.randint(3, 300, (2, 24))
    assert max_diff(ours(input_ids).logits, reference(input_ids).logits) <= TOLERANCE
    ours_tokens = ours.generate(input_ids[:1], max_new_tokens=32, min_new_tokens=32, do_sample=False)
    ref_tokens = reference.generate(input_ids[:1], max_new_tokens=32, min_new_tokens=32, do_sample=False)
    assert torch.equal(ours_tokens, ref_tokens)


def test_left_padded_batch_matches_unpadded_rows(pair):
    ours, _ = pair
    long_row = torch.randint(3, 300, (1, 12))
    short_row = torch.randint(3, 300, (1, 7))
    batch = torch.cat([long_row, torch.cat([torch.zeros(1, 5, dtype=torch.long), short_row], dim=1)])
    mask = torch.ones_like(batch)
    mask[1, :5] = 0
    settings = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False)
    padded = ours.generate(batch, attention_mask=mask, **settings)[:, 12:]
    assert torch.equal(padded[0], ours.generate(long_row, **settings)[0, 12:])
    assert torch.equal(padded[1], ours.generate(short_row, **settings)[0, 7:])
    logits = ours(batch, attention_mask=mask).logits
    assert max_diff(logits[1, 5:], ours(short_row).logits[0]) <= TOLERANCE
