from mlxq.engine.stops import StopStringMatcher


def feed_all(stops, pieces):
    matcher = StopStringMatcher(stops)
    out = []
    for piece in pieces:
        result = matcher.feed(piece)
        out.append(result.text)
        if result.stopped:
            return "".join(out), True
    return "".join(out) + matcher.flush(), False


def test_stop_inside_one_piece_cuts_before_it():
    assert feed_all(("END",), ["hello END world"]) == ("hello ", True)


def test_stop_split_across_pieces_is_never_leaked():
    matcher = StopStringMatcher(("<|stop|>",))
    assert matcher.feed("abc<|st").text == "abc"  # the partial marker is held back
    result = matcher.feed("op|>tail")
    assert result.stopped and result.text == ""


def test_held_text_is_released_when_it_turns_out_not_to_be_a_stop():
    matcher = StopStringMatcher(("STOP",))
    assert matcher.feed("xST").text == "x"
    assert matcher.feed("AY").text == "STAY"


def test_flush_returns_held_partial_at_end_of_stream():
    assert feed_all(("STOP",), ["abcST"]) == ("abcST", False)


def test_earliest_of_several_stops_wins():
    assert feed_all(("b", "a"), ["xxab"]) == ("xx", True)


def test_no_stops_passes_everything_through():
    assert feed_all((), ["a", "b"]) == ("ab", False)
