"""Two ingress replicas share what the model replied: the ids behind a reply that one
ingress saw reach the other through the cluster's ReplyStore (a real actor on the
loopback cluster), per tenant; a store that does not answer only means re-tokenizing."""

import asyncio

import pytest

pytestmark = pytest.mark.distributed

NAMESPACE = "prefix-cache-reply-store-test"


def test_a_reply_one_ingress_remembered_is_recalled_by_another(ray_loopback_cluster):
    from actors.reply_store import SharedReplies
    from cluster.engine.text import ReplyMemory

    first = SharedReplies(NAMESPACE, ReplyMemory(), timeout_s=30)
    second = SharedReplies(NAMESPACE, ReplyMemory(), timeout_s=30)
    first.remember("tenant-a", "Paris is the capital.", [11, 12, 13])
    assert second.recall("tenant-a", "Paris is the capital.") is None   # not known here yet

    async def prefetch():
        await second.prefetch("tenant-a", ["Paris is the capital.", "never said"])
        await second.prefetch("tenant-b", ["Paris is the capital."])     # another tenant's is not theirs
    asyncio.run(prefetch())
    assert second.recall("tenant-a", "Paris is the capital.") == [11, 12, 13]
    assert second.recall("tenant-a", "never said") is None
    assert second.recall("tenant-b", "Paris is the capital.") is None
    assert second.stats == {"remote_hits": 1, "remote_misses": 2, "remote_failures": 0}


def test_a_store_that_does_not_answer_in_time_changes_nothing(ray_loopback_cluster):
    from actors.reply_store import SharedReplies
    from cluster.engine.text import ReplyMemory

    class Silent:   # a store handle whose calls never complete
        class recall_many:
            @staticmethod
            def remote(*args):
                return asyncio.get_running_loop().create_future()

    replies = SharedReplies(NAMESPACE, ReplyMemory(), timeout_s=0.2)
    replies._store = Silent()
    asyncio.run(replies.prefetch("t", ["some reply"]))
    assert replies.recall("t", "some reply") is None and replies.stats["remote_failures"] == 1
