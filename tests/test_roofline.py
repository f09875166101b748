"""roofline.py: the paper prediction follows the roofline it teaches."""
import roofline
from benches import common

DRAFT = roofline.Shape(*common.SHAPES["llama-1b"])
TARGET = roofline.Shape(*common.SHAPES["llama-8b"])
CONTEXT = (256, 128)


def test_ar_on_a_gpu_is_bound_by_reading_the_weights():
    _, seconds = roofline.predict("ar", DRAFT, TARGET, 1, 1, CONTEXT, "h200", 0.7)
    _, bandwidth, _ = roofline.GPUS["h200"]
    weights = TARGET.matmul_params() * roofline.BF16
    assert weights / bandwidth < seconds < 1.1 * weights / bandwidth


def test_extra_rows_are_nearly_free_until_compute_binds():
    one = roofline.forward_seconds(TARGET, 1, CONTEXT, 1, "h200")
    twenty = roofline.forward_seconds(TARGET, 20, CONTEXT, 4, "h200")
    thousands = roofline.forward_seconds(TARGET, 4096, CONTEXT, 4, "h200")
    assert twenty < 1.05 * one
    assert thousands > 5 * one


def test_smc_emits_k_plus_one_and_sd_its_expected_acceptance():
    smc_tokens, _ = roofline.predict("smc", DRAFT, TARGET, 4, 4, CONTEXT, "h100", 0.7)
    assert smc_tokens == 5
    assert roofline.sd_tokens(1.0, 4) == 5
    assert roofline.sd_tokens(0.0, 4) == 1
    assert abs(roofline.sd_tokens(0.5, 2) - 1.75) < 1e-12


def test_the_table_says_it_is_a_prediction(capsys):
    roofline.main(["--gpu", "h100"])
    out = capsys.readouterr().out
    assert out.startswith("Predicted on paper for NVIDIA H100")
    assert "| smc | 4 | 4 |" in out
