"""Each live adapter's listener slot: stable while live, bounded, freed slots reused last."""

from warmup_tools.front.smg_grpc.slots import SlotTable


def test_adapters_keep_their_slots_while_live_and_get_them_back():
    table = SlotTable(4)
    changes = table.update(["sql", "legal"])
    assert changes.opened == ((1, "sql"), (2, "legal")) and changes.closed == ()
    assert table.update(["legal", "sql"]).opened == ()  # order does not move anyone
    changes = table.update(["legal"])
    assert changes.closed == ((1, "sql"),) and table.slot_of("legal") == 2
    changes = table.update(["legal", "support"])
    assert changes.opened == ((3, "support"),)  # an unused slot before sql's freed one
    changes = table.update(["legal", "support", "sql"])
    assert changes.opened == ((1, "sql"),)  # its own slot back
    assert table.assigned() == {"sql": 1, "legal": 2, "support": 3}


def test_never_more_than_the_bound_and_a_freed_slot_goes_to_a_newcomer():
    table = SlotTable(3)  # the base model's slot and two adapters'
    table.update(["a", "b", "c"])
    assert table.assigned() == {"a": 1, "b": 2} and table.unplaced == ("c",)
    changes = table.update(["b", "c"])
    assert changes.closed == ((1, "a"),) and changes.opened == ((1, "c"),) and table.unplaced == ()
    assert SlotTable(1).update(["a"]).opened == ()
