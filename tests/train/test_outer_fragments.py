"""Fragments by layer and the global model in the trainer's outer loop
(jcomp.train.outer.fragments, jcomp.train.outer.islands), in process on configs/tiny.py's
model (2 layers: fragment 0 = embedding + layer 0, fragment 1 = layer 1 +
final norm). Marked slow: they compile train steps and syncs."""
import jax
import numpy as np
import pytest

from tests.train.test_outer import _Run, _np

pytestmark = pytest.mark.slow


def _part(tree, part):
    """A part of a params tree ([I, ...] leaves) as numpy: the leaf or its layers."""
    leaf = np.asarray(jax.tree.leaves(tree)[part.leaf])
    return leaf if part.layers is None else leaf[:, part.layers[0]:part.layers[1]]


def test_fragments_sync_in_turn_and_the_anchor_is_the_global_model():
    """every=2, 2 fragments: fragment 1 syncs after steps 1, 3, fragment 0 after
    2, 4. Right after a fragment's sync every island holds the same values of
    its layers (bit for bit), the other fragment's layers still differ across
    the islands, and the global model (`Syncs.global_params`, the anchor) equals
    what each fragment's last sync left; its validation loss is the loss of
    those params, and not the islands' mean loss."""
    r = _Run(**{"outer.every": 2, "outer.fragments": 2, "optim.warmup_steps": 0})
    plan = r.syncs.plan
    assert [[p.layers for p in parts if p.layers] for parts in plan] == [[(0, 1)] * 12,
                                                                        [(1, 2)] * 12]
    last = {}  # fragment -> island 0's params of its parts after its last sync
    for t in range(1, 5):
        r.step(t)
        synced = 1 if t % 2 else 0
        params = _np(r.state["params"])
        for f, parts in enumerate(plan):
            for part in parts:
                x = _part(params, part)
                if f == synced:
                    assert np.array_equal(x[0], x[1]), (t, part)
                    last[(f, part)] = x[0]
                elif t > 1 or part.layers is not None or f == 1:
                    assert not np.array_equal(x[0], x[1]), (t, part)
        glob = _np(r.syncs.global_params(r.state))
        for (f, part), want in last.items():
            got = _part(glob, part)
            assert np.array_equal(got[0], want) and np.array_equal(got[1], want), (t, part)
    # Every part has synced: the anchor as params, built by hand from the syncs.
    by_hand = [np.array(x) for x in jax.tree.leaves(_np(r.state["params"]))]
    for (f, part), want in last.items():
        if part.layers is None:
            by_hand[part.leaf] = np.stack([want, want])
        else:
            a, b = part.layers
            by_hand[part.leaf][:, a:b] = want
    tree = jax.tree.unflatten(jax.tree.structure(r.state["params"]), by_hand)
    shardings = jax.tree.map(lambda x: x.sharding, r.state["params"])
    tree = jax.tree.map(jax.device_put, tree, shardings)
    val = [np.random.default_rng(9).integers(0, r.run.model.vocab_size,
                                             (r.run.train.batch_size, r.run.data.seq_len + 1))]
    want = r.steps.val_loss(None, tree, val)
    got = r.steps.val_loss(None, r.syncs.global_params(r.state), val)
    islands = r.steps.val_loss(None, r.state["params"], val)
    assert got == want and got != islands, (got, want, islands)
