"""Proposal B: OScaR with a rotation fitted offline per layer and KV head.

``pca_hadamard`` (``oscarp``): the keys' second-moment matrix ``C = E[k k^T]`` on
calibration windows (post-RoPE, the k bias's RoPE'd part taken out as in
``bias_offset``), its eigenvectors ``V`` (PCA basis), and ``R = H V^T``: project on the
principal directions, then mix them evenly with the Walsh-Hadamard matrix, so that every
rotated channel has the same second moment ``tr(C) / D`` (exactly, for any ``C``:
``(R C R^T)_jj = sum_i H_ji^2 lambda_i``). ``random_orthogonal`` (``oscaro``): a seeded
Haar-random orthogonal matrix per layer and head, the control. Hadamard itself is
``oscarb`` (``oscar`` without a k bias). ``select`` (``oscars``): per layer and KV head
either the Hadamard matrix or no rotation (the identity: OScaR's per-token norm on KIVI's
channels, ``ots_only``'s keys on ``k - RoPE_t(b_k)``; the values stay OScaR's, rotated),
whichever gives the smaller query-weighted key error ``E[e^T C_q e]`` (``C_q`` the second
moment of the head's queries, so the expected squared score error) on the calibration
windows: a rotation spreads the key error
evenly over the channels, which on a model whose queries avoid the channels with the
widest key groups (Qwen2.5, ACCURACY.md) costs more score error than it saves. With
``criterion="attention"`` (``oscars<b>_attn1``) each key's error counts in proportion to the
squared attention it receives on the calibration windows (``key_weight``: sum over the
group's queries of p^2): a score error delta_t moves the output by about p_t delta_t
(v_t - o), so the heads whose few sink keys take most of the attention are judged on
those keys. ``criterion="output"`` (``oscars<b>_out1``) measures instead what each
candidate does to the attention output: ||softmax(q k_hat^T) v - softmax(q k^T) v||^2 summed
over sampled calibration queries (``queries`` at ``query_pos``) and the group's heads.
``criterion="nll"`` (``oscars<b>_nll1``) takes, of every head rotated, none, and the two
selections above, the one with the smallest NLL of the model on the calibration windows.

Then OScaR as ``oscarb``: per-token norm of the rotated key, per-channel INT-b over G
tokens, values as OScaR's. Bytes per token: OScaR's (50 at D = 64); the matrices are
model constants (D^2 per KV head per layer), not cache. A decode kernel would apply a
dense D x D rotation to q and k instead of the fast transform (the same cost at D <= 128
on a tensor core).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from oscar_jax.methods import base
from oscar_jax.methods.bias_offset import OscarBias

ROTATIONS = ("pca_hadamard", "random_orthogonal", "select")
CRITERIA = ("score", "attention", "output", "nll")  # how ``select`` compares its candidates


def hadamard_matrix(d: int) -> np.ndarray:
    """The orthonormal Walsh-Hadamard matrix of size d (a power of two), float64."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"d={d} must be a power of two")
    h = np.ones((1, 1))
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(d)


def pca_hadamard(x: np.ndarray) -> np.ndarray:
    """R = H V^T for samples x [N, D]: V the eigenvectors of the second moment x^T x / N
    (descending eigenvalues). Orthogonal, float64."""
    x = np.asarray(x, np.float64)
    c = x.T @ x / len(x)
    w, vec = np.linalg.eigh(c)
    vec = vec[:, np.argsort(w)[::-1]]
    return hadamard_matrix(x.shape[1]) @ vec.T


def random_orthogonal(d: int, rng: np.random.Generator) -> np.ndarray:
    """A Haar-random orthogonal matrix (QR of a Gaussian, signs fixed), float64."""
    q, r = np.linalg.qr(rng.standard_normal((d, d)))
    return q * np.sign(np.diag(r))


@dataclasses.dataclass(frozen=True)
class OscarRotation(OscarBias):
    """OScaR (with the k-bias offset) under a per-layer, per-KV-head fitted rotation."""

    rotation: str = "pca_hadamard"
    seed: int = 0
    criterion: str = "score"
    chosen: str = ""  # criterion "nll": the losses of its candidates (calibration_note)

    needs_calibration = True

    def __post_init__(self):
        super().__post_init__()
        if self.rotation not in ROTATIONS:
            raise ValueError(f"rotation={self.rotation!r} must be one of {ROTATIONS}")
        base._int("seed", self.seed, 0)
        if self.criterion not in CRITERIA:
            raise ValueError(f"criterion={self.criterion!r} must be one of {CRITERIA}")
        if self.criterion != "score" and self.rotation != "select":
            raise ValueError(f"criterion={self.criterion!r} applies to rotation='select' "
                             f"only, not {self.rotation!r}")  # fmt: skip

    @property
    def needs_queries(self) -> bool:  # type: ignore[override]
        return self.rotation == "select"

    @property
    def needs_attention(self) -> bool:  # type: ignore[override]
        return self.criterion == "attention"

    @property
    def needs_query_samples(self) -> bool:  # type: ignore[override]
        return self.criterion in ("output", "nll")

    @property
    def needs_loss(self) -> bool:  # type: ignore[override]
        return self.criterion == "nll"

    def fake_quant_kv(
        self,
        k: Float[Array, "B H T D"],
        v: Float[Array, "B H T D"],
        key_offset: Float[Array, "T H D"] | None = None,
        *,
        state: dict | None = None,
    ):
        base.check_kv(k, v, 8, self.group_size)
        st = self.calibrated_state() if state is None else state
        rot = jnp.asarray(st["rotation"], jnp.float32)  # [H, D, D]
        if rot.shape != (k.shape[1], k.shape[3], k.shape[3]):
            raise ValueError(f"rotation.shape={rot.shape} must be [H, D, D] of k {k.shape}")
        cfg = self.base("oscar")
        off = None
        if key_offset is not None:
            off = jnp.swapaxes(key_offset.astype(jnp.float32), 0, 1)[None]  # [1, H, T, D]
        kh = base.oscar_keys_fake_quant(k, cfg, off, rotation=rot)
        return kh, base.values_fake_quant(v, cfg)

    def fit(self, k, v, rope, key_offset=None, query_cov=None, output_cov=None,
            key_weight=None, queries=None, query_pos=None, loss=None) -> OscarRotation:  # fmt: skip
        """``rotation`` [L, H, D, D] from the calibration keys [L, N, H, T, D] minus the
        k bias's RoPE'd part [L, T, H, D] (when given); ``select`` also wants the queries'
        second moments ``query_cov`` [L, H, D, D] (criterion "attention": the keys'
        ``key_weight`` [L, N, H, T]; "output": ``queries`` [L, N, Hq, S, D] at positions
        ``query_pos`` [S] and the values v; "nll": those and ``loss``, a calibrated config
        -> its NLL on the calibration windows) and records its choice as ``hadamard`` [L, H]
        (1: rotated, 0: not)."""
        del output_cov
        if self.criterion == "nll":
            return self._fit_nll(k, v, key_offset, query_cov, queries, query_pos, loss)
        if self.rotation == "select":
            return self._fit_select(k, v, key_offset, query_cov, key_weight, queries, query_pos)
        k = np.asarray(k, np.float64)
        n_l, _, n_h, _, d = k.shape
        rng = np.random.default_rng(self.seed)
        mats = np.zeros((n_l, n_h, d, d))
        for li in range(n_l):
            x = k[li]
            if key_offset is not None:
                x = x - np.swapaxes(np.asarray(key_offset[li], np.float64), 0, 1)[None]
            for h in range(n_h):
                if self.rotation == "pca_hadamard":
                    mats[li, h] = pca_hadamard(x[:, h].reshape(-1, d))
                else:
                    mats[li, h] = random_orthogonal(d, rng)
        return self.replace(calibration=base.Calibration(rotation=mats))

    def calibration_note(self) -> str | None:
        if self.rotation != "select" or self.calibration is None:
            return None
        pick = self.calibration.arrays["hadamard"]  # [L, H]
        per = " ".join("".join("H" if x else "-" for x in row) for row in pick)
        how = {"score": "", "attention": " (key errors weighted by attention)",
               "output": " (by the attention output's error)",
               "nll": f" (by the calibration NLL: {self.chosen})"}[self.criterion]  # fmt: skip
        return (f"Hadamard kept in {int(pick.sum())} of {pick.size} (layer, KV head) "
                f"pairs{how}; per layer (H rotated, - not): {per}")  # fmt: skip

    def _fit_select(self, k, v, key_offset, query_cov, key_weight=None, queries=None,
                    query_pos=None) -> OscarRotation:  # fmt: skip
        k = np.asarray(k, np.float32)
        n_l, n_n, n_h, n_t, d = k.shape
        if query_cov is None or np.shape(query_cov) != (n_l, n_h, d, d):
            raise ValueError(f"rotation='select' needs query_cov [L, H, D, D] = "
                             f"{(n_l, n_h, d, d)}: got {np.shape(query_cov)}")  # fmt: skip
        wts = np.ones((n_l, n_n, n_h, n_t), np.float32)
        if self.criterion == "attention":
            if key_weight is None or np.shape(key_weight) != (n_l, n_n, n_h, n_t):
                raise ValueError(f"criterion='attention' needs key_weight [L, N, H, T] = "
                                 f"{(n_l, n_n, n_h, n_t)}: got {np.shape(key_weight)}")  # fmt: skip
            wts = np.asarray(key_weight, np.float32)
        if self.criterion == "output":
            qs = np.shape(queries)
            ok = len(qs) == 5 and qs[:2] == (n_l, n_n) and qs[4] == d and qs[2] % n_h == 0
            if queries is None or query_pos is None or not ok or np.shape(query_pos) != qs[3:4]:
                raise ValueError(f"criterion='output' needs queries [L, N, Hq, S, D] with "
                                 f"(L, N, D) = {(n_l, n_n, d)} and query_pos [S]: got "
                                 f"{qs} and {np.shape(query_pos)}")  # fmt: skip
        cands = np.stack([np.broadcast_to(hadamard_matrix(d), (n_h, d, d)),
                          np.broadcast_to(np.eye(d), (n_h, d, d))])  # fmt: skip
        mats = np.zeros((n_l, n_h, d, d))
        pick = np.zeros((n_l, n_h))
        cfg = self.base("oscar")
        for li in range(n_l):
            x = jnp.asarray(k[li])  # [N, H, T, D]
            off = None
            if key_offset is not None:
                off = jnp.swapaxes(jnp.asarray(key_offset[li], jnp.float32), 0, 1)[None]
            errs = []  # per head: the candidate's error under the criterion
            for rot in cands:
                xh = base.oscar_keys_fake_quant(x, cfg, off, rotation=jnp.asarray(rot, jnp.float32))
                if self.criterion == "output":
                    errs.append(np.asarray(_output_error(
                        jnp.asarray(queries[li], jnp.float32), x, xh,
                        jnp.asarray(v[li], jnp.float32), jnp.asarray(query_pos))))  # fmt: skip
                    continue
                e = xh - x
                wl = jnp.asarray(wts[li])  # [N, H, T]
                num = jnp.einsum("nhtd,hde,nhte,nht->h", e, jnp.asarray(query_cov[li]), e, wl)
                errs.append(np.asarray(num / jnp.maximum(jnp.sum(wl, axis=(0, 2)), 1e-30)))
            rotated = errs[0] <= errs[1]  # [H]
            mats[li] = np.where(rotated[:, None, None], cands[0], cands[1])
            pick[li] = rotated
        return self.replace(calibration=base.Calibration(rotation=mats, hadamard=pick))

    def _fit_nll(self, k, v, key_offset, query_cov, queries, query_pos, loss) -> OscarRotation:
        """Criterion "nll": of whole-model candidates -- every head rotated (E), none
        (``ots_only``'s keys on k - RoPE_t(b_k), OScaR's rotated values), the "score" and
        the "output" selections -- the one whose calibrated config has the smallest
        ``loss`` (the calibration windows' NLL): per-head choices that are each right alone
        can lose to rotating every head (errors add up across layers), which only the
        model's own loss shows."""
        if not callable(loss):
            raise ValueError(f"criterion='nll' needs loss, a callable config -> calibration "
                             f"NLL: got {type(loss).__name__}")  # fmt: skip
        n_l, _, n_h, _, d = np.shape(k)
        picks = {"all": np.ones((n_l, n_h)), "none": np.zeros((n_l, n_h))}
        for crit in ("score", "output"):
            fitted = self.replace(criterion=crit)._fit_select(
                k, v, key_offset, query_cov, None, queries, query_pos)  # fmt: skip
            picks[crit] = fitted.calibration.arrays["hadamard"]
        had, eye = hadamard_matrix(d), np.eye(d)
        losses, cands = {}, {}
        for name, pick in picks.items():
            mats = np.where(pick[:, :, None, None] > 0, had, eye)
            cands[name] = self.replace(
                calibration=base.Calibration(rotation=mats, hadamard=pick))  # fmt: skip
            losses[name] = float(loss(cands[name]))
        best = min(losses, key=losses.get)
        chosen = ", ".join(f"{n} {x:.4f}" + (" *" if n == best else "") for n, x in losses.items())
        return cands[best].replace(chosen=chosen)


def _output_error(q, k, k_hat, v, pos):
    """[H]: sum over windows, query heads of the group and the sampled queries of
    ||softmax(q k_hat^T) v - softmax(q k^T) v||^2 (causal: a query at pos[s] sees keys
    <= pos[s]; scale 1 / sqrt(D)), for q [N, Hq, S, D], k, k_hat, v [N, H, T, D]."""
    n, hq, s_, d = q.shape
    h, t = k.shape[1], k.shape[2]
    qg = q.reshape(n, h, hq // h, s_, d)
    mask = jnp.arange(t)[None, :] <= pos[:, None]  # [S, T]

    def attend(kk):
        sc = jnp.einsum("nhgsd,nhtd->nhgst", qg, kk, precision="highest") / np.sqrt(d)
        p = jax.nn.softmax(jnp.where(mask, sc, -jnp.inf), axis=-1)
        return jnp.einsum("nhgst,nhtd->nhgsd", p, v, precision="highest")

    return jnp.sum((attend(k_hat) - attend(k)) ** 2, axis=(0, 2, 3, 4))
