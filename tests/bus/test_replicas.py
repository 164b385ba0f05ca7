"""How many copies of each stream and bucket a service asks for, by the cluster it finds."""

import pytest

from shared.bus.provision import ProvisionError, replicas_for


@pytest.mark.parametrize("requested, cluster_size, replicas", [
    (None, 1, 1),   # one server: one copy
    (None, 2, 1),   # two nodes cannot keep a quorum when one goes: no point in two copies by default
    (None, 3, 3),   # three: one may go
    (None, 5, 3),
    (1, 3, 1),      # asked for: as asked
    (2, 3, 2),
    (5, 5, 5),
])
def test_replicas_follow_the_cluster_unless_asked(requested, cluster_size, replicas):
    assert replicas_for(requested, cluster_size) == replicas


@pytest.mark.parametrize("requested, cluster_size, says", [
    (3, 1, "needs a NATS cluster of 3 nodes or more; this one has 1"),
    (0, 3, "must be 1 to 5"),
    (6, 7, "must be 1 to 5"),
])
def test_replicas_the_cluster_cannot_hold_are_refused_with_the_reason(requested, cluster_size, says):
    with pytest.raises(ProvisionError, match=says):
        replicas_for(requested, cluster_size)
