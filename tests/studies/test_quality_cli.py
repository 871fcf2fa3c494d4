"""The studies' options live in ``python -m studies.quality_cli``, not in the product's ``fusionrag`` commands."""

from __future__ import annotations

import pytest

from fusionrag.cli import main

STUDY_ONLY = ("--kb-limit", "--max-passage-words", "--neighbour-order", "--same-document", "--fuse-only-evaluated",
              "--full-reference", "--reuse-full-cache")


def _help(run, argv, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        run(argv)
    assert exc.value.code == 0
    return capsys.readouterr().out


def test_the_ablation_flags_are_the_studies_not_the_products(capsys):
    from studies import quality_cli

    quality = _help(main, ["bench", "quality", "--help"], capsys)
    preprocess = _help(main, ["preprocess", "--help"], capsys)
    study = _help(quality_cli.main, ["--help"], capsys)
    assert "--methods" in quality and "--top-n" in preprocess  # the right pages were read
    for flag in STUDY_ONLY:
        assert flag not in quality and flag in study
    assert "--neighbour-order" not in preprocess and "--same-document" not in preprocess


def test_the_studies_options_reach_the_spec():
    import argparse

    from studies.quality_cli import add_study_args, study_overrides

    from fusionrag.bench.cli import add_quality_args, quality_spec

    p = argparse.ArgumentParser()
    add_quality_args(p)
    add_study_args(p)
    args = p.parse_args(["--data", "x.jsonl", "--out", "o", "--limit", "5", "--kb-limit", "10", "--same-document",
                         "--neighbour-order", "nearest_last", "--fuse-only-evaluated", "--neighbours", "question",
                         "--full-reference", "ref", "--reuse-full-cache", "--max-passage-words", "40"])
    spec = quality_spec(args, **study_overrides(args))
    assert (spec.kb_limit, spec.max_passage_words, spec.reuse_full_cache) == (10, 40, True)
    assert str(spec.full_reference) == "ref"
    assert (spec.fuse.neighbour_order, spec.fuse.same_document) == ("nearest_last", True)
    assert spec.stores.fuse_only_evaluated and spec.stores.suffix == "-nbquestion"
    assert spec.extra_meta == {"neighbour_order": "nearest_last", "same_document": True, "kv_dtype": spec.kv_dtype,
                               "neighbours": "question"}
