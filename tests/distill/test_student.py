"""The student built from a teacher: its config and init, its invariants, the refusals."""

from __future__ import annotations

import pytest
import torch

from looplm import LoopLM
from looplm.config_base import ConfigError
from looplm.distill import DistillRunConfig, init_student, load_teacher, run_distill, student_config
from looplm.distill.student import block_paths
from looplm.mixers.attention import SoftmaxAttention
from tests.distill.helpers import GDN, frozen_teacher
from tests.invariants import assert_decodes_like_full_forward, assert_strictly_causal, prefill_then_tokens


def test_student_keeps_attention_in_f_and_shares_everything_else():
    teacher = frozen_teacher(n_kv_heads=2)
    student = LoopLM(student_config(teacher.cfg, GDN, [1]))
    source = init_student(student, teacher)
    assert [type(student.get_submodule(p).attn) is SoftmaxAttention for (p,) in block_paths(student.cfg)] == \
        [False, True, False, False]
    t_state, s_state = teacher.state_dict(), student.state_dict()
    for name in ("embed.weight", "head.weight", "norm.weight", "core.0.1.ffn_norm.weight", "coda.0.ffn.up.weight",
                 "core.0.0.attn.qkv.weight", "core.0.0.attn.o_proj.bias"):  # block 1 = core.0.0 keeps attention
        assert torch.equal(s_state[name], t_state[name]), name
    q, k, v = t_state["core.0.1.attn.qkv.weight"].split([32, 16, 16], dim=0)
    assert torch.equal(s_state["core.0.1.attn.q_proj.weight"], q)
    # GQA: the teacher's 2 key/value heads (8 dims each) repeated for GDN's 4 heads
    assert torch.equal(s_state["core.0.1.attn.k_proj.weight"], k.view(2, 8, 32).repeat_interleave(2, 0).reshape(32, 32))
    assert torch.equal(s_state["core.0.1.attn.v_proj.weight"], v.view(2, 8, 32).repeat_interleave(2, 0).reshape(32, 32))
    assert torch.equal(s_state["core.0.1.attn.o_proj.weight"], t_state["core.0.1.attn.o_proj.weight"])
    assert source["core.0.1.attn.k_proj.weight"] == "teacher core.0.1.attn k"


OURO_AXES = dict(layout="2R2", norm="rmsnorm", mlp="swiglu", bias=False, norm_placement="sandwich",
                 loop_input_norm=True, halting={"kind": "exit_gate", "threshold": 0.5})


@pytest.mark.parametrize("axes", [{}, OURO_AXES], ids=["looped", "ouro-axes"])
def test_distilled_student_is_causal_and_decodes_like_its_full_forward(axes):
    teacher = frozen_teacher(**axes)
    student = LoopLM(student_config(teacher.cfg, GDN, [0, 3] if not axes else [1])).eval()
    init_student(student, teacher)
    x = torch.randint(0, 257, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_strictly_causal(student, x, positions=[3, 7], shift=5, vocab=257, atol=1e-5)
        assert_decodes_like_full_forward(student, x, [prefill_then_tokens(5, 11), [4, 9, 11]], atol=1e-4)


@pytest.mark.parametrize("raw,field", [
    ({"distill": {"mixer": {"kind": "attention"}}}, "distill.mixer.kind"),
    ({"distill": {"mixer": {"kind": "nsa"}}}, "distill.mixer.kind"),
    ({"distill": {"keep_fraction": 1.0}}, "distill.keep_fraction"),
    ({"distill": {"selector": "greedy"}}, "distill.selector"),
    ({"distill": {"lengths": [64, 32]}}, "distill.lengths"),
    ({"distill": {"kd": {"top_k": 0}}}, "distill.kd.top_k"),
    ({"distill": {"kd": {"uniform_fraction": 0.95}}}, "distill.kd.uniform_fraction"),
    ({"distill": {"stage2": {"data": {"source": "x"}}}}, "distill.stage2.data"),
    ({"distill": {"stage1": {"max_steps": -1}}}, "distill.stage1.max_steps"),
    ({"model": {"d_model": 64}}, "model"),
])
def test_bad_distill_config_names_the_field(raw, field):
    with pytest.raises(ConfigError) as err:
        DistillRunConfig.from_dict(raw)
    assert err.value.field == field, str(err.value)


def test_lengths_must_divide_seq_len_and_layers_must_exist():
    with pytest.raises(ConfigError, match="divide data.seq_len=64"):
        DistillRunConfig.from_dict({"distill": {"lengths": [24, 64]}, "data": {"seq_len": 64}})
    with pytest.raises(ConfigError, match="distill.stage3.data.seq_len"):
        DistillRunConfig.from_dict({"distill": {"stage3": {"data": {"seq_len": 0}}}})
    assert DistillRunConfig.from_dict({}).distill.stage_lengths(64) == (16, 32, 64)
    with pytest.raises(ConfigError, match="below 4"):
        DistillRunConfig.from_dict({"distill": {"layers": [1, 4]}}).distill.keep_count(4)
    assert DistillRunConfig.from_dict({}).distill.keep_count(24) == 6  # LT2: 6 of 24


def test_a_teacher_without_softmax_attention_everywhere_is_refused():
    teacher = frozen_teacher()
    hybrid = student_config(teacher.cfg, GDN, [1])
    with pytest.raises(ConfigError, match="teacher model.mixer.kind"):
        student_config(hybrid.replace(hybrid=None), GDN, [])
    with pytest.raises(ConfigError, match="teacher model.hybrid"):
        student_config(hybrid.replace(mixer=teacher.cfg.mixer), GDN, [])


def test_a_hugging_face_checkpoint_is_a_teacher(tmp_path):
    transformers = pytest.importorskip("transformers")
    from tests.conftest import randomize_weights

    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=257, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=48, max_position_embeddings=64))
    randomize_weights(hf, 0)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    teacher = load_teacher(tmp_path / "hf")
    assert not any(p.requires_grad for p in teacher.parameters())
    student = LoopLM(student_config(teacher.cfg, GDN, [1])).eval()
    init_student(student, teacher)
    ids = torch.randint(0, 257, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_decodes_like_full_forward(student, ids, [prefill_then_tokens(4, 9)], atol=1e-4)
    # the whole pipeline on it (a dense teacher: one "loop"), on the built-in corpus in bytes
    cfg = DistillRunConfig.from_dict({
        "distill": {"mixer": {"kind": "gated_deltanet", "expand_v": 1.0, "chunk_size": 16}, "keep_fraction": 0.5,
                    "stage1": {"max_steps": 2}, "stage2": {"max_steps": 2}},
        "data": {"source": "pydoc", "tokenizer": "byte", "seq_len": 16, "val_batches": 1},
        "train": {"out_dir": str(tmp_path / "out"), "batch_size": 2, "eval_every": 0, "sample_tokens": 0,
                  "device": "cpu", "precision": "fp32"},
    })
    results = run_distill(tmp_path / "hf", cfg, progress=False)
    assert len(results["select"]["layers"]) == 1 and results["2"]["steps"] == 2
