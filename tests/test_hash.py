"""jaxodc hash v1: native CPU (1 and many threads) against an independent numpy implementation of
the spec in csrc/hash/hash.h; SHA-256 / HMAC against hashlib / hmac."""
import hashlib
import hmac

import numpy as np
import pytest

from jaxodc import _C
from jaxodc.comm.hashing import hash_array, hash_bytes, hash_state

M = (1 << 64) - 1
P1, P2, P3, P4, P5 = (0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9,
                      0x85EBCA77C2B2AE63, 0x27D4EB2F165667C5)
U = np.uint64


def _rotl(x, r):
    return (x << U(r)) | (x >> U(64 - r))


def _aval(h):
    h = h ^ (h >> U(33))
    h = h * U(P2)
    h = h ^ (h >> U(29))
    h = h * U(P3)
    return h ^ (h >> U(32))


@np.errstate(over="ignore")
def reference_hash(data: bytes) -> int:
    """Pure numpy re-implementation of the spec, vectorised over blocks and lanes."""
    n = len(data)
    nblocks = max(1, -(-n // 65536))
    buf = np.zeros(nblocks * 65536, np.uint8)
    buf[:n] = np.frombuffer(data, np.uint8)
    words = buf.view("<u8").reshape(nblocks, 256, 32)  # [block, j, lane]: word index j*32 + lane
    with np.errstate(over="ignore"):
        k = np.arange(nblocks, dtype=U)[:, None]
        lane = np.arange(32, dtype=U)[None, :]
        h = U(P5) ^ ((k * U(32) + lane) * U(P2))
        for j in range(256):
            h = _rotl(h + words[:, j, :] * U(P2), 31) * U(P1)
        b = np.full(nblocks, P3, U)
        for ln in range(32):
            b = _rotl(b ^ _aval(h[:, ln]), 27) * U(P1) + U(P4)
        level = [int(v) for v in b]
    while len(level) > 1:
        up = []
        for i in range(0, len(level) - 1, 2):
            a, c = level[i], level[i + 1]
            ra = ((a << 17) | (a >> 47)) & M
            up.append(int(_aval(U(((ra ^ (c * P2 & M)) * P1 + P4) & M))))
        if len(level) % 2:
            up.append(level[-1])
        level = up
    return int(_aval(U(level[0] ^ (n * P5 & M))))


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 65535, 65536, 65537, 3 * 65536 + 12345, 5 * 65536])
def test_native_matches_numpy_spec(n):
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
    want = reference_hash(data)
    assert hash_bytes(data, threads=1) == want
    assert hash_bytes(data, threads=3) == want
    assert hash_bytes(data, threads=0) == want


def test_thread_count_does_not_change_large_hash():
    x = np.random.default_rng(1).standard_normal(3_000_001).astype(np.float32)  # 183 blocks
    values = {hash_array(x, threads=t) for t in (1, 2, 3, 7, 64)}
    assert len(values) == 1
    assert values.pop() == reference_hash(x.tobytes())


def test_hash_is_sensitive_to_every_bit_and_length():
    x = np.zeros(100_000, np.float32)
    base = hash_array(x)
    seen = {base}
    for idx in (0, 1, 65536 // 4, 99_999):
        y = x.copy()
        y.view(np.uint32)[idx] ^= 1
        seen.add(hash_array(y))
    seen.add(hash_array(x[:-1]))
    seen.add(hash_bytes(x.tobytes() + b"\0"))  # zero padding alone must not collide
    assert len(seen) == 7


def test_hash_array_dtypes_and_layouts():
    import ml_dtypes
    rng = np.random.default_rng(2)
    base = rng.standard_normal((37, 53)).astype(np.float32)
    for a in (base, base.astype(np.float16), base.astype(ml_dtypes.bfloat16), base.astype(np.int64)):
        assert hash_array(a) == reference_hash(np.ascontiguousarray(a).tobytes())
    assert hash_array(base.T) == reference_hash(np.ascontiguousarray(base.T).tobytes())


def test_hash_jax_array_on_cpu_equals_numpy():
    import jax.numpy as jnp
    x = np.arange(70_000, dtype=np.int32)
    assert hash_array(jnp.asarray(x)) == hash_array(x)


def test_hash_state_flattens_and_hashes_each_key():
    rng = np.random.default_rng(3)
    state = {"w": rng.standard_normal(1000).astype(np.float32),
             "opt": {"mu": np.zeros(10, np.float32), "step": np.array(3, np.int64)}}
    h = hash_state(state)
    assert set(h) == {"w", "opt/mu", "opt/step"}
    assert h["w"] == reference_hash(state["w"].tobytes())
    assert h["opt/step"] == reference_hash(np.int64(3).tobytes())


@pytest.mark.parametrize("n", [0, 3, 55, 56, 63, 64, 65, 1000])
def test_sha256_matches_hashlib(n):
    data = bytes(range(256)) * 4
    assert _C.sha256(data[:n]) == hashlib.sha256(data[:n]).digest()


@pytest.mark.parametrize("klen", [0, 5, 64, 65, 200])
def test_hmac_sha256_matches_hmac(klen):
    key = bytes((i * 7) % 256 for i in range(klen))
    for msg in (b"", b"challenge", bytes(300)):
        assert _C.hmac_sha256(key, msg) == hmac.new(key, msg, hashlib.sha256).digest()
