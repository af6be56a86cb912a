"""The mixed precision policy (jaxodc.modeling.precision): its short names and specs, their
canonical spelling (what ranks compare), and errors for bad ones."""
import jax.numpy as jnp
import numpy as np
import pytest

from jaxodc.modeling.precision import MixedPrecision, cast_inputs, precision_of


@pytest.mark.parametrize("text, policy, canonical", [
    ("fp32", MixedPrecision("fp32"), "fp32"),
    ("bf16", MixedPrecision("bf16"), "bf16"),
    ("bf16,reduce=bf16", MixedPrecision("bf16"), "bf16"),
    ("bf16, reduce=fp32", MixedPrecision("bf16", "fp32"), "bf16,reduce=fp32"),
    ("bf16,keep_inputs", MixedPrecision("bf16", cast_inputs=False), "bf16,keep_inputs"),
    ("bf16,reduce=fp32,keep_inputs", MixedPrecision("bf16", "fp32", False), "bf16,reduce=fp32,keep_inputs"),
])
def test_specs_parse_to_policies_and_back(text, policy, canonical):
    assert precision_of(text) == policy
    assert str(policy) == canonical and precision_of(canonical) == policy
    assert precision_of(policy) is policy


def test_dtypes_of_a_policy():
    p = precision_of("bf16,reduce=fp32")
    assert p.compute_dtype == jnp.bfloat16 and p.grad_dtype == jnp.float32
    assert precision_of("bf16").grad_dtype == jnp.bfloat16
    assert precision_of("fp32").compute_dtype == jnp.float32


@pytest.mark.parametrize("bad, message", [
    ("fp16", "must start with one of"),
    ("bf16,reduce=fp8", "reduce_dtype must be one of"),
    ("bf16,fast", "unknown part 'fast'"),
])
def test_bad_specs_say_what_is_wrong(bad, message):
    with pytest.raises(ValueError, match=message):
        precision_of(bad)
    with pytest.raises(TypeError, match="str or MixedPrecision"):
        precision_of(16)


def test_cast_inputs_casts_floats_only():
    batch = {"x": np.ones((2, 3), np.float32), "y": np.arange(2, dtype=np.int32), "m": {"w": np.ones(2)}}
    out = cast_inputs(batch, jnp.bfloat16)
    assert out["x"].dtype == jnp.bfloat16 and out["m"]["w"].dtype == jnp.bfloat16 and out["y"].dtype == np.int32
    np.testing.assert_array_equal(np.asarray(out["y"]), batch["y"])
    assert cast_inputs(batch, jnp.float32) is batch
