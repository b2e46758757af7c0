"""A replica that leaves hands its sessions under way to the survivor (issue 52).

What the autoscale bench showed: the replica a scale-in stopped held 30 sessions, 29 of
them finished (8 turns, 7 hits each) and one under way (6 turns); its peers pulled the
16 most *valuable* sequences, all finished ones, L3 had lost the live session's blocks
(the pool was full), and the live session's next turn found 31 of its 807 tokens. Here:
two workers on their peer channels, no L3, no Ray; the hand-off's peer part as the
worker runs it (``actors.elastic.hand_off``)."""

import asyncio

from actors.elastic import hand_off
from actors.peer import PeerClient
from tests.unit.helpers import make_worker, run_worker

SECRET = "s52"


class SurvivorOps:
    """``PeerOps`` with one survivor that pulls over its peer channel from the leaving worker."""

    def __init__(self, survivor):
        self.survivor = survivor
        self.offered: list[tuple[int, ...]] = []

    async def targets(self) -> list[str]:
        return [self.survivor.worker_id]

    async def ask_pull(self, target, offer) -> int:
        self.offered.append(offer.tokens)
        return await self.survivor.pull(offer)


def test_the_survivor_pulls_the_session_under_way_not_the_sessions_that_ended():
    leaving = make_worker("h-leave", peer_host="127.0.0.1", peer_secret=SECRET, handoff_peer_prefixes=2)
    survivor = make_worker("h-stay", peer_host="127.0.0.1", peer_secret=SECRET)

    async def link_for(holder):
        return PeerClient(holder, leaving.peer.address, secret=SECRET)
    survivor.link_for = link_for
    try:
        # Three sessions that ended: two turns each (the second found the first: one hit).
        for s in range(3):
            first = [s + 1] * 4 + list(range(100, 192))
            out = [i.token for i in run_worker(leaving, first)]
            run_worker(leaving, first + out + [s + 1] * 8)
        # The session under way: one turn, the last thing the leaving worker ran.
        live = [7] * 4 + list(range(100, 192))
        out = [i.token for i in run_worker(leaving, live)]
        ops = SurvivorOps(survivor)
        report = asyncio.run(hand_off(leaving, ops, 10.0))
        assert (report.peer_prefixes, report.peer_tokens) == (2, 99 + 111)
        assert ops.offered[0] == tuple(live + out[:3])   # 96 prompt + 3 computed tokens, first
        # Its next turn lands on the survivor and finds the whole previous turn there.
        turn = live + out + [7] * 4
        items = run_worker(survivor, turn)
        assert items[0].cached_tokens == 99 and items[0].cached_tokens >= 0.9 * len(turn)
    finally:
        leaving.close()
        survivor.close()
