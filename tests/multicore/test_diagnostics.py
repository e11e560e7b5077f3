from hyperpar.multicore.diagnostics import manifest_difference, value_difference


def test_value_difference_names_every_differing_rank() -> None:
    assert value_difference("sig", ["a", "a", "a"], [0, 1, 2]) is None
    assert value_difference("sig", ["a", "b", "a", "c"], [0, 1, 2, 3]) == \
        "sig: rank 0 has 'a'; rank 1 has 'b'; rank 3 has 'c'"


def test_manifest_difference_names_rank_position_binding_id_and_signature() -> None:
    same = [(1, "s1"), (2, "s2")]
    assert manifest_difference("m", [same, list(same)], [0, 1]) is None
    text = manifest_difference("m", [same, [(1, "s1"), (2, "other")], same[:1]], [0, 4, 7])
    assert text == ("m: at position 1 rank 4 has binding id 2 with signature other where rank 0 has "
                    "binding id 2 with signature s2; at position 1 rank 7 has nothing where rank 0 has "
                    "binding id 2 with signature s2")
