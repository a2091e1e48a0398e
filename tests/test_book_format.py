"""The book's prose and table formatting: numbers to their precision, lists and changes read as sentences."""

from __future__ import annotations

import pandas as pd

from looped_kv import book


def test_a_settings_table_formats_each_number_alone():
    """A mixed column (a training record) showed "119.500000" and "657792"."""
    record = pd.Series({"parameters": 657792, "minutes": 119.5, "mix": [0.2, 0.2, 0.6], "lr": 0.00123456},
                       name="training")
    html = book.table(record).to_html()
    assert "657,792" in html and "119.500000" not in html and ">120<" in html
    assert "0.00123" in html and "[0.2, 0.2, 0.6]" in html


def test_a_column_over_several_orders_of_magnitude_keeps_significant_digits():
    """Chapter 4's ratio column printed 73.8931 beside 0.0984: four decimals taken from its smallest value."""
    html = book.table(pd.DataFrame({"ratio": [0.0984, 0.634, 73.8931, 9.2333]})).to_html()
    assert "73.9" in html and "73.8931" not in html and "0.0984" in html and "9.23" in html
    assert book.significant(1234.5) == "1,234" and book.significant(0.012345) == "0.0123"


def test_lists_and_changes_read_as_sentences():
    assert book.listing(["a"]) == "a" and book.listing(["a", "b"]) == "a and b"
    assert book.listing(["a", "b", "c"]) == "a, b and c" and book.listing([]) == ""
    assert book.change(-0.234, unit="nats") == "falls by 0.23 nats"
    assert book.change(0.0449) == "rises by 0.04" and book.change(0.001) == "does not change"
