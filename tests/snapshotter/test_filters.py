"""containerd's filter syntax: what parses, what it matches, and the errors for what does not."""

from __future__ import annotations

import pytest

from bootseer.snapshotter import filters
from bootseer.snapshotter.errors import InvalidArgument

# A small corpus in the shape of containerd's filter tests: absent fields read as "".
CORPUS = [
    {"name": "foo", "labels": {"foo": "true"}},
    {"name": "bar"},
    {"name": "foo", "labels": {"foo": "present", "more complex label": "true"}},
    {"name": "bar", "labels": {"bar": "true"}},
    {"name": "fooer", "labels": {'more complex label with \\ and ".post': "present"}},
    {"name": "baz", "other": "too complex, yo"},
    {"name": "bazo", "other": "abc"},
    {"name": "compound", "labels": {"foo": "omg_asdf.asdf-qwer"}},
]


def adapt(entry):
    def field(fieldpath):
        head = fieldpath[0]
        if head in ("name", "other"):
            value = entry.get(head, "")
            return value, bool(value)
        if head == "labels":
            key = ".".join(fieldpath[1:])
            labels = entry.get("labels", {})
            return labels.get(key, ""), key in labels
        return "", False

    return field


def matching(text: str) -> list[int]:
    parsed = filters.parse(text)
    return [i for i, entry in enumerate(CORPUS) if parsed.match(adapt(entry))]


@pytest.mark.parametrize(
    "text, expected",
    [
        ("", [0, 1, 2, 3, 4, 5, 6, 7]),
        ("name", [0, 1, 2, 3, 4, 5, 6, 7]),
        ("labels.foo", [0, 2, 7]),
        ("labels.foo,name", [0, 2, 7]),
        ("labels.foo==true", [0]),
        ("labels.foo==omg_asdf.asdf-qwer", [7]),
        ("name==bar", [1, 3]),
        ("name!=bar", [0, 2, 4, 5, 6, 7]),
        ("name==bar,labels.bar", [3]),
        ('other=="too complex, yo"', [5]),
        ("other~=[abc]+,name!=foo", [5, 6]),
        ("other~=/[abc]+/,name!=foo", [5, 6]),
        ("other~=/[abc]{1,2}/,name!=foo", [5, 6]),
        ('other~=/[abc]{0,1}"\\//,name!=foo', []),  # valid, matches nothing
        ("other~=|^a.c$|", [6]),
        ("name==bar,labels.bar==true", [3]),
        ("name==bar,labels.bar==wrong", []),
        ('name==foo,labels."more complex label"', [2]),
        ('labels."more complex label with \\\\ and \\""==present', []),
        ('labels."more complex label with \\\\ and \\"".post==present', [4]),
        ("  name == bar  ,  labels.bar  ", [3]),
        ('name=="\\x66oo"', [0, 2]),
        ('name=="\\u0066oo"', [0, 2]),
        ('name=="\\146oo"', [0, 2]),
        ("name~=^ba", [1, 3, 5, 6]),
        ("other!=abc", [0, 1, 2, 3, 4, 5, 7]),  # an absent field differs from any non-empty value
        ('other!=""', [5, 6]),
    ],
)
def test_matches_like_containerd(text, expected):
    assert matching(text) == expected


def test_parse_all_is_an_or_and_empty_matches_everything():
    assert filters.parse_all(None).match(adapt(CORPUS[0]))
    assert filters.parse_all([]).match(adapt(CORPUS[0]))
    any_of = filters.parse_all(["name==baz", "labels.bar"])
    assert [i for i, e in enumerate(CORPUS) if any_of.match(adapt(e))] == [3, 5]


def test_parsed_structure():
    parsed = filters.parse('labels."containerd.io/gc.root"==x,name~=/^a/')
    assert parsed == filters.All(
        (
            filters.Selector(("labels", "containerd.io/gc.root"), filters.Operator.EQUAL, "x"),
            filters.Selector(("name",), filters.Operator.MATCHES, "^a", parsed.filters[1].regex),
        )
    )


@pytest.mark.parametrize(
    "text, message",
    [
        ("labels.|foo|==x", "may only be quoted with '\"'"),
        ('labels.?"quoted"==present', "expected a field name"),
        ("name==foo,", "expected a field name"),
        ("labels.", "expected a field name"),
        ("image~=,id?=?fbaq", "expected a value"),
        ("labels.ns/key==value", "expected an operator"),
        ("labels.key==/value", "quotes only a regular expression"),
        ("name~=/value", "quoted literal not terminated"),
        ('name=="abc', "quoted literal not terminated"),
        ("name=bar", "unsupported operator '='"),
        ("name!==bar", "unsupported operator '!=='"),
        ("name bar", "expected an operator"),
        ("name==a b", "unexpected input 'b'"),
        ('name=="a\\qb"', "illegal escape sequence"),
        ('name=="\\xZZ"', "illegal numeric escape"),
        ('name=="\\400"', "illegal octal escape"),
        ("name~=/a\\\"b/", "illegal escape sequence"),  # \" is not an escape inside /.../
        ("name~=[a-", "invalid regular expression"),
        ("==x", "expected a field name"),
        ("name==.x", "expected a value"),
    ],
)
def test_syntax_errors_are_invalid_argument_with_position(text, message):
    with pytest.raises(InvalidArgument) as raised:
        filters.parse(text)
    assert message in str(raised.value)
    assert "filters:" in str(raised.value)


def test_error_shows_where():
    with pytest.raises(InvalidArgument, match=r"\[name==foo, >\|,\|< x\]|position"):
        filters.parse("name==foo,,x")
    with pytest.raises(InvalidArgument) as raised:
        filters.parse("name==a b")
    assert "[name==a  >|b|< ]" in str(raised.value)


def test_parse_all_reports_the_bad_filter():
    with pytest.raises(InvalidArgument):
        filters.parse_all(["name==ok", "name=bad"])


def quoted_regex(pattern: str) -> str:
    """A ``name~=|...|`` filter whose decoded value is ``pattern`` (backslashes escaped)."""
    return "name~=|" + pattern.replace("\\", "\\\\") + "|"


@pytest.mark.parametrize(
    "pattern, value, matches",
    [
        (r"^sha256:\d+$", "sha256:42", True),
        (r"\pL+", "é", True),  # Unicode classes, as Go's regexp
        ("(?i)FOO", "foo", True),
        ("(?P<name>a)b", "ab", True),  # Go's named-group syntax
        ("(a+)+$", "a" * 40 + "!", False),  # catastrophic for a backtracking engine; linear in RE2
    ],
)
def test_regex_is_re2_like_go(pattern, value, matches):
    parsed = filters.parse(quoted_regex(pattern))
    assert parsed.match(lambda fieldpath: (value, True)) is matches


@pytest.mark.parametrize("pattern", [r"(a)\1", "a(?=b)", "a(?!b)", "(?<=a)b", "a{1001}"])
def test_regex_syntax_go_refuses_is_invalid_argument(pattern):
    # Backreferences, lookarounds and repeats over 1000 are errors in Go's regexp too.
    with pytest.raises(InvalidArgument, match="invalid regular expression"):
        filters.parse(quoted_regex(pattern))


@pytest.mark.parametrize("depth", [1001, 5000, 100_000])
def test_deeply_nested_regex_is_invalid_argument(depth):
    pattern = "(" * depth + "a" + ")" * depth
    with pytest.raises(InvalidArgument, match="nests too deeply"):
        filters.parse(f"name~=|{pattern}|")


def test_nesting_at_go_limit_and_brackets_in_classes_are_fine():
    pattern = "(" * 1000 + "a" + ")" * 1000
    assert filters.parse(f"name~=|{pattern}|").match(lambda fieldpath: ("a", True))
    # Parentheses inside a character class or escaped are no groups.
    assert filters.parse(quoted_regex("[(]{3}" + "\\(" * 2000)).match(lambda fieldpath: ("(((" + "(" * 2000, True))
