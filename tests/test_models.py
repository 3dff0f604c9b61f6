"""Our model math vs transformers' for every supported architecture (float32, tiny random models)."""
import pytest
import torch

import hetero
from conftest import ARCHES, rel_err

PROMPT = [3, 17, 42, 99, 5, 150, 7, 8, 64, 33, 2, 11]


@pytest.mark.parametrize("arch", ARCHES)
def test_logits_match_transformers(tiny, arch):
    folder, ref = tiny(arch)
    engine = hetero.load(folder, device="cpu", weights="f32", kv_dtype="f32", tokenizer=False)
    ours = engine.logits(PROMPT)
    with torch.no_grad():
        theirs = ref(torch.tensor([PROMPT])).logits[0].float()
    assert ours.shape == (len(PROMPT), ref.config.vocab_size)
    assert ours.dtype == torch.float32
    assert rel_err(ours, theirs) <= 1e-4


@pytest.mark.parametrize("arch", ARCHES)
def test_greedy_tokens_match_transformers(tiny, arch):
    folder, ref = tiny(arch)
    engine = hetero.load(folder, device="cpu", weights="f32", kv_dtype="f32", tokenizer=False)
    ours = [c.token for c in engine.generate(PROMPT, max_new_tokens=32, temperature=0.0)]
    with torch.no_grad():
        out = ref.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=32, min_new_tokens=32,
                           pad_token_id=0)
    assert ours == out[0, len(PROMPT):].tolist()


def test_unsupported_architecture_names_it(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(hetero.UserError, match="GPT2LMHeadModel.*supported.*LlamaForCausalLM"):
        hetero.load(tmp_path, tokenizer=False)


def test_batch_generation_matches_single(tiny):
    """Several prompts decoded together give each the tokens it gets alone (continuous batching)."""
    folder, _ = tiny("llama")
    engine = hetero.load(folder, device="cpu", weights="f32", kv_dtype="f32", tokenizer=False)
    prompts = [PROMPT, PROMPT[:5], [9, 8, 7, 6, 5, 4, 3, 2, 1] * 3]
    alone = [[c.token for c in engine.generate(p, max_new_tokens=12 + 4 * i, temperature=0.0)]
             for i, p in enumerate(prompts)]
    together = [[] for _ in prompts]
    for c in engine.generate(prompts, max_new_tokens=20, temperature=0.0):
        together[c.index].append(c.token)
    for i in range(len(prompts)):
        assert together[i][: len(alone[i])] == alone[i]
    assert not engine.cache.seqs  # every finished sequence freed its blocks


def test_sharded_checkpoint_reads_like_a_single_file(tiny, tmp_path):
    folder, ref = tiny("qwen2")
    ref.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    a = hetero.load(tmp_path, device="cpu", weights="f32", kv_dtype="f32", tokenizer=False).logits(PROMPT)
    b = hetero.load(folder, device="cpu", weights="f32", kv_dtype="f32", tokenizer=False).logits(PROMPT)
    assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_host_embedding_rows_are_the_tables(tiny, dtype):
    """A host-memory table's rows gathered by numpy (`Model.host_rows`, into a new tensor or a
    slice of a staging buffer) are torch indexing's, in any dtype, repeated ids included."""
    folder, _ = tiny("llama")
    model = hetero.load(folder, device="cpu", weights="f32", kv_dtype="f32", tokenizer=False).runner.model
    model.embed_w = model.embed_w.to(dtype)
    ids = torch.tensor([5, 0, 5, model.embed_w.shape[0] - 1])
    want = model.embed_w[ids]
    assert torch.equal(model.host_rows(ids), want)
    staging = torch.zeros(8, model.embed_w.shape[1], dtype=dtype)
    model.host_rows(ids, out=staging[:4])
    assert torch.equal(staging[:4], want) and not staging[4:].any()
    assert torch.equal(model.embed(ids), want.to(model.act_dtype))
