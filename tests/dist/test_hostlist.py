import pytest

from hpc_rlhf.dist.hostlist import expand_hostlist, parse_tasks_per_node


@pytest.mark.parametrize("text, hosts", [
    ("node1", ["node1"]),
    ("cpu7,gpu3", ["cpu7", "gpu3"]),
    ("node[1-3]", ["node1", "node2", "node3"]),
    ("gpu-[001-004,010],cpu7", ["gpu-001", "gpu-002", "gpu-003", "gpu-004", "gpu-010", "cpu7"]),
    ("n[08-11]", ["n08", "n09", "n10", "n11"]),  # padding is the width of the first bound
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),
    ("n[0099-0101]", ["n0099", "n0100", "n0101"]),
    ("r[1-2]n[01-02]", ["r1n01", "r1n02", "r2n01", "r2n02"]),  # the last group varies fastest
    ("r[1,3]-gpu[1-2].ib", ["r1-gpu1.ib", "r1-gpu2.ib", "r3-gpu1.ib", "r3-gpu2.ib"]),
    ("a[1,3-4,7],b[2],c", ["a1", "a3", "a4", "a7", "b2", "c"]),
    ("[1-2]x", ["1x", "2x"]),
    ("node[5-5]", ["node5"]),
    ("  node[1-2]\n", ["node1", "node2"]),  # surrounding white space, as read from a file or variable
    ("node1.cluster.org,node2.cluster.org", ["node1.cluster.org", "node2.cluster.org"]),
])
def test_expand_hostlist(text, hosts):
    assert expand_hostlist(text) == hosts


def test_expand_large_range_keeps_order_and_count():
    hosts = expand_hostlist("gpu[0001-1024]")
    assert len(hosts) == 1024
    assert hosts[0] == "gpu0001" and hosts[511] == "gpu0512" and hosts[-1] == "gpu1024"


@pytest.mark.parametrize("text, message", [
    ("", "is empty"),
    ("   ", "is empty"),
    ("node[1-3", "never closed"),
    ("node1-3]", "no matching '['"),
    ("node[[1-2]]", "nested '['"),
    ("node[3-1]", "'3-1' goes backwards"),
    ("node[]", "empty brackets"),
    ("node[1,,2]", "empty entry"),
    ("node[a-c]", "'a-c'"),
    ("node[1-]", "'1-'"),
    ("node1,,node2", "empty host name"),
    ("node1,", "empty host name"),
    ("node1 node2", "white space"),
])
def test_expand_hostlist_rejects_malformed(text, message):
    with pytest.raises(ValueError) as info:
        expand_hostlist(text)
    assert message in str(info.value)
    if text.strip():
        assert repr(text) in str(info.value) or f"'{text}'" in str(info.value)  # names the whole list


@pytest.mark.parametrize("text, counts", [
    ("4", [4]),
    ("4(x2),3", [4, 4, 3]),
    ("2(x3)", [2, 2, 2]),
    ("1,2,3", [1, 2, 3]),
    ("8(x1),0", [8, 0]),
])
def test_parse_tasks_per_node(text, counts):
    assert parse_tasks_per_node(text) == counts


@pytest.mark.parametrize("text", ["", "4(x)", "4(x2", "x2", "4(2)", "4(x0)", "-1", "4,,3", "a"])
def test_parse_tasks_per_node_rejects_malformed(text):
    with pytest.raises(ValueError, match="tasks per node"):
        parse_tasks_per_node(text)
