"""``looplm eval --exit``: the loss paid and compute saved of zero-shot exits against the
full loop, printed and in JSON; ``looplm generate --exit`` logs the passes it realised; a
malformed exit is one error line."""

from __future__ import annotations

import json

import pytest

from looplm.cli import main


def test_eval_reports_loss_paid_and_compute_saved_per_exit(tmp_path, capsys, caplog):
    caplog.set_level("INFO", logger="looplm")
    run = tmp_path / "run"
    assert main(["train", "tiny-base", f"train.out_dir={run}", "train.max_steps=2", "train.eval_every=0",
                 "train.save_every=2", "train.sample_tokens=0", "model.d_model=32", "data.seq_len=32",
                 "train.batch_size=4", "--no-progress"]) == 0
    capsys.readouterr()
    # entropy below 100 nats holds at once: every position exits after step 1 of 2 (1+2R2+1: 4 of 6 passes)
    assert main(["eval", str(run), "--batches", "1", "--exit", "entropy:100", "--exit", "kl:1e-12", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["block_passes_per_token"] == 6.0
    at_once, never = result["exits"]
    assert at_once["exit"] == "entropy:100" and at_once["block_passes_per_token"] == 4.0
    assert at_once["compute_saved"] == pytest.approx(1 / 3)
    assert at_once["loss_paid"] == pytest.approx(at_once["val_loss"] - result["val_loss"])
    assert never["compute_saved"] == 0.0 and never["loss_paid"] == pytest.approx(0.0, abs=1e-6)
    assert main(["eval", str(run), "--batches", "1", "--exit", "entropy:100"]) == 0
    assert "exit entropy:100" in capsys.readouterr().out
    assert main(["generate", str(run), "--prompt", "def ", "--max-new-tokens", "4", "--temperature", "0",
                 "--exit", "entropy:100"]) == 0
    assert capsys.readouterr().out.startswith("def ")
    assert "exit entropy:100: 4.00 block passes per token (full loop 6)" in caplog.text
    with pytest.raises(SystemExit) as error:
        main(["eval", str(run), "--exit", "kl"])
    assert error.value.code == 2
    assert "CRITERION:THRESHOLD" in capsys.readouterr().err
