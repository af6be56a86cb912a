"""Churn stress: peers spawned and SIGKILLed every 0.5-2 s while training steps go on (outgoing
links capped at 20 MB/s so all-reduces last long enough for kills to land inside them).

CI runs ~90 s; set JAXODC_CHURN_MINUTES for longer runs (or run bench/churn.py --minutes N)."""
import os

import pytest

MINUTES = float(os.environ.get("JAXODC_CHURN_MINUTES", "1.5"))


@pytest.mark.slow
@pytest.mark.timeout(int(MINUTES * 60 + 180))
def test_churn_keeps_progress_and_bit_identical_state(tmp_path, capsys):
    from jaxodc.bench import churn
    res = churn.Churn(MINUTES * 60, max_peers=6, seed=int(os.environ.get("JAXODC_CHURN_SEED", "0")),
                      stall_s=30.0, workdir=str(tmp_path), link_bps=20e6).run()
    with capsys.disabled():
        print(f"\n[churn] {res['seconds']} s: {res['peer_changes']} peer changes "
              f"({res['spawns']} spawns, {res['kills']} SIGKILLs), {res['steps']} peer-steps, "
              f"max revision {res['max_revision']}, longest gap {res['longest_gap_s']} s, "
              f"steps by world {res['peer_steps_by_world']}, service {res['service']}")
    assert res["failures"] == [], res["failures"]
    assert res["peer_changes"] >= MINUTES * 60 / 2.5          # the churn really happened
    assert res["kills"] >= 5 and res["service"]["accepted"] >= res["spawns"] // 2
    assert res["revisions_checked"] >= 50 and res["max_revision"] >= 50
    assert max(res["peer_steps_by_world"]) >= 3              # several peers trained together
