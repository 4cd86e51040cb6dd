"""CITATION.cff's references name the papers as docs/PAPERS.md's BibTeX does: the same
authors, in order, and the same year."""

import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parent.parent


def _plain(title: str) -> str:
    return " ".join(title.replace("{", "").replace("}", "").lower().split())


def citation_references() -> dict[str, tuple[list[str], int]]:
    """Title: (``family-names, given-names`` of each author, year) of CITATION.cff's references."""
    text = "\n" + (REPO / "CITATION.cff").read_text().split("\nreferences:\n")[1]
    out = {}
    for block in re.split(r"\n  - type: ", text)[1:]:
        title = re.search(r'title: "(.+)"', block).group(1)
        authors = [
            f"{family}, {given}"
            for family, given in re.findall(
                r"\{family-names: ([^,]+), given-names: ([^}]+)\}", block
            )
        ]
        authors += re.findall(r"- name: (.+)", block)
        out[_plain(title)] = (authors, int(re.search(r"year: (\d{4})", block).group(1)))
    return out


def bibtex_entries() -> dict[str, tuple[list[str], int]]:
    text = (REPO / "docs" / "PAPERS.md").read_text()
    out = {}
    for entry in re.findall(r"@\w+\{[^@]+?\n\}", text):
        field = {
            key: " ".join(value.split())
            for key, value in re.findall(r"(\w+)\s*=\s*\{((?:[^{}]|\{[^{}]*\})*)\}", entry)
        }
        authors = [a.strip() for a in field["author"].split(" and ")]
        out[_plain(field["title"])] = (authors, int(field["year"]))
    return out


def test_citation_references_match_the_papers_bibtex():
    references, bibtex = citation_references(), bibtex_entries()
    assert len(references) == 5, sorted(references)
    for title, (authors, year) in references.items():
        assert title in bibtex, f"CITATION.cff cites {title!r}, which docs/PAPERS.md lacks"
        assert (authors, year) == bibtex[title], (title, authors, year, bibtex[title])
