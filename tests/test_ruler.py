"""kvcompress.datasets.ruler: the RULER synthetic suite, sized in model tokens, seeded, with
evidence spans that decode to the needles, prompts ending in RULER's answer prefix, RULER scorers."""

import json

import kvcompress  # noqa: F401  (first: preloads OpenBLAS before mlx)
import pytest

from kvcompress.datasets import (
    RULER_TASKS, load_dataset, max_answer_tokens, prompt_tokens, sample_prompt, score, validate,
)
from kvcompress.datasets import scorers
from kvcompress.errors import ConfigError
from kvcompress.model import load_tokenizer

BUDGETS = {**{t: 128 for t in RULER_TASKS if t.startswith("niah")}, "vt": 30, "cwe": 120, "fwe": 50}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="module")
def suite(tok):
    """Every offline task, two samples each, at 1024 tokens."""
    return load_dataset("ruler", tokenizer=tok, context_tokens=1024, num_samples=2, seed=0).to_list()


def meta(sample):
    return json.loads(sample["metadata"])


def test_every_offline_task_by_default_sized_with_its_answer_budget(tok, suite):
    assert [s["task"] for s in suite[::2]] == list(RULER_TASKS)
    for sample in suite:
        budget = max_answer_tokens(sample)
        assert budget == BUDGETS[sample["task"]] == meta(sample)["answer_budget"]
        length = len(prompt_tokens(sample, tok))
        assert length == sample["context_tokens"]
        # RULER: prompt + tokens_to_generate <= max_seq_length, and the haystack fills it
        assert 0.9 * 1024 <= length + budget <= 1024, (sample["task"], length)


def test_generators_are_deterministic_by_seed(tok, suite):
    again = load_dataset("ruler", tokenizer=tok, context_tokens=1024, num_samples=2, seed=0).to_list()
    assert again == suite
    other = load_dataset("ruler", tokenizer=tok, task=["niah_single_2", "vt"], context_tokens=1024,
                         num_samples=2, seed=1).to_list()
    ours = [s for s in suite if s["task"] in ("niah_single_2", "vt")]
    assert all(a["answers"] != b["answers"] for a, b in zip(other, ours))
    # a sample does not depend on how many were asked for
    one = load_dataset("ruler", tokenizer=tok, task="cwe", context_tokens=1024, num_samples=1, seed=0)[0]
    assert one == next(s for s in suite if s["task"] == "cwe")


def test_prompts_end_with_the_answer_prefix_after_the_generation_prompt(tok, suite):
    for sample in suite:
        text = tok.decode(prompt_tokens(sample, tok))
        prefix = meta(sample)["answer_prefix"]
        assert prefix and text.endswith("<|im_start|>assistant\n" + prefix), sample["task"]
        assert text.index(sample["context"][:100]) < text.rindex(sample["question"])
    single = next(s for s in suite if s["task"] == "niah_single_3")
    assert single["question"].startswith("What is the special magic uuid for")
    assert meta(single)["answer_prefix"].endswith("mentioned in the provided text is")
    many = next(s for s in suite if s["task"] == "niah_multivalue")
    assert meta(many)["answer_prefix"].endswith("mentioned in the provided text are")


def test_question_split_is_where_the_question_part_starts(tok, suite):
    for sample in suite:
        prompt = sample_prompt(sample, tok)
        head, tail = tok.decode(prompt.tokens[:prompt.question_start]), tok.decode(prompt.tokens[prompt.question_start:])
        assert head.rstrip().endswith(sample["context"][-30:].rstrip())
        assert sample["question"] in tail  # in the head only inside cwe's solved example
        assert head.count(sample["question"]) == meta(sample)["few_shot"].count(sample["question"])


def test_evidence_spans_decode_to_the_needles(tok, suite):
    for sample in suite:
        info, prompt = meta(sample), sample_prompt(sample, tok)
        if sample["task"].startswith("niah"):  # the needles of the asked keys (the others are distractors)
            asked = [n for n in info["needles"] if any(f" for {k} is: " in n for k in info["asked"])]
            expected = sorted(asked, key=sample["context"].index)
        elif sample["task"] == "vt":
            expected = sorted(info["chain"], key=sample["context"].index)
        else:
            assert prompt.evidence == []
            continue
        decoded = [tok.decode(prompt.tokens[a:b]).strip() for a, b in prompt.evidence]
        assert decoded == [e.strip() for e in expected]
        assert all(prompt.evidence[i][1] <= prompt.evidence[i + 1][0] for i in range(len(decoded) - 1))
        assert prompt.evidence[-1][1] <= prompt.question_start


def test_evidence_spans_of_niah_and_passkey(tok):
    for name, params in (("niah", {"variant": "multikey"}), ("passkey", {})):
        for sample in load_dataset(name, tokenizer=tok, context_tokens=512, num_samples=2, **params):
            prompt = sample_prompt(sample, tok)
            decoded = [tok.decode(prompt.tokens[a:b]).strip() for a, b in prompt.evidence]
            if name == "niah":
                assert decoded == meta(sample)["needles"]
            else:
                key = sample["answers"][0]
                assert decoded == [f"The pass key is {key}. Remember it. {key} is the pass key."]


def test_task_contents(tok, suite):
    by_task = {s["task"]: s for s in suite}
    noise = by_task["niah_single_1"]["context"].split("\n")
    assert sum(line.startswith("One of the special magic numbers") for line in noise) == 1
    assert all(line.startswith(("The grass is green.", "One of")) for line in noise)
    mk2 = by_task["niah_multikey_2"]
    lines = mk2["context"].split("\n")
    assert len(lines) > 10 and all(line.startswith("One of the special magic numbers for ") for line in lines)
    assert sum(f"is: {mk2['answers'][0]}." in line for line in lines) == 1
    mq = by_task["niah_multiquery"]
    assert len(mq["answers"]) == 4 and all(k in mq["question"] for k in meta(mq)["asked"])
    vt = by_task["vt"]
    assert len(vt["answers"]) == 5 and vt["context"].count("VAR ") == 9
    few_shot = meta(vt)["few_shot"]  # one solved example of about 500 tokens, with its answer
    assert few_shot.startswith("Memorize and track") and 400 <= len(tok.encode(few_shot)) <= 500
    cwe = by_task["cwe"]
    words = cwe["context"].split(" ")[1::2]
    assert all(words.count(w) == 6 for w in cwe["answers"])
    assert max(words.count(w) for w in set(words) - set(cwe["answers"])) == 1
    fwe = by_task["fwe"]
    counts = {w: fwe["context"].split(" ").count(w) for w in fwe["answers"] + ["..."]}
    assert counts["..."] > counts[fwe["answers"][0]] > counts[fwe["answers"][1]] > counts[fwe["answers"][2]]


def test_scores_are_rulers_string_match(suite):
    mv = next(s for s in suite if s["task"] == "niah_multivalue")
    assert score(mv, " ".join(mv["answers"][:3]).upper()) == 0.75  # case-insensitive, fraction found
    vt = next(s for s in suite if s["task"] == "vt")
    assert score(vt, " ".join(vt["answers"])) == 1.0


@pytest.mark.parametrize("prediction, answers, all_, part", [
    # hand cases of RULER's scripts/eval/synthetic/constants.py (there x100, per sample)
    ("The number is 1234567.", ["1234567"], 1.0, 1.0),
    ("abc DEF", ["def", "xyz"], 0.5, 1.0),
    ("nothing here", ["def", "xyz"], 0.0, 0.0),
    ("1 2 3", ["1", "2", "3", "4"], 0.75, 1.0),
    ("", ["a"], 0.0, 0.0),
])
def test_string_match_all_and_part_against_rulers_formula(prediction, answers, all_, part):
    assert scorers.string_match_all(prediction, answers) == all_
    assert scorers.string_match_part(prediction, answers) == part
    # RULER's own expressions, written out
    assert all_ == sum(1.0 if r.lower() in prediction.lower() else 0.0 for r in answers) / len(answers)
    assert part == max(1.0 if r.lower() in prediction.lower() else 0.0 for r in answers)


@pytest.mark.parametrize("params, field", [
    ({"task": "niah_single_4"}, "task"),
    ({"task": []}, "task"),
    ({"task": ["vt", "qa_3"]}, "task"),
    ({"task": "vt", "context_tokens": 512}, "context_tokens"),
    ({"num_samples": 0}, "num_samples"),
])
def test_bad_parameters_name_the_field(params, field):
    with pytest.raises(ConfigError) as err:
        validate("ruler", params)
    assert str(err.value).startswith(field)


def test_several_questions_about_one_haystack(tok):
    rows = load_dataset("ruler", tokenizer=tok, task="niah_single_2", questions=3, context_tokens=1024,
                        num_samples=2, seed=0).to_list()
    assert len(rows) == 6 and [r["id"][-3:] for r in rows] == ["-q0", "-q1", "-q2"] * 2
    first = rows[:3]
    assert len({r["context"] for r in first}) == 1 and len({r["question"] for r in first}) == 3
    assert len({r["answers"][0] for r in first}) == 3
    for r in first:
        prompt = sample_prompt(r, tok)
        (a, b), = prompt.evidence  # each question's evidence is its own needle
        assert r["answers"][0] in tok.decode(prompt.tokens[a:b])
        assert len(prompt.tokens) + 128 <= 1024
    single = load_dataset("ruler", tokenizer=tok, task="niah_single_2", context_tokens=1024, num_samples=1,
                          seed=0)[0]
    assert single["id"] == "niah_single_2-1024-s0-0"  # questions=1 keeps the one-question ids
    with pytest.raises(ConfigError, match="questions"):
        validate("ruler", {"questions": 0})
    with pytest.raises(ConfigError, match="task"):
        validate("ruler", {"task": ["vt"], "questions": 2})


DATA = __import__("pathlib").Path(__file__).parent / "data"


def test_qa_tasks_through_the_hub_loader_on_local_files_in_its_schema(tok):
    files = {"qa_1": str(DATA / "ruler_squad_v2.jsonl"), "qa_2": str(DATA / "ruler_hotpotqa.jsonl")}
    rows = load_dataset("ruler", tokenizer=tok, task=["qa_1", "qa_2"], qa_files=files, context_tokens=512,
                        num_samples=3, seed=0).to_list()
    assert [r["task"] for r in rows] == ["qa_1"] * 3 + ["qa_2"] * 3
    for r in rows:
        prompt = sample_prompt(r, tok)
        text = tok.decode(prompt.tokens)
        assert text.endswith("<|im_start|>assistant\n Answer:") and r["question"].startswith("Question: ")
        assert len(prompt.tokens) + 32 <= 512 and r["context"].startswith("Document ")
        gold = [tok.decode(prompt.tokens[a:b]) for a, b in prompt.evidence]  # the gold documents
        assert gold and all(g.strip().startswith("Document ") for g in gold)
        assert any(answer.lower() in " ".join(gold).lower() for answer in r["answers"])
        assert score(r, f"I think {r['answers'][-1]}.") == 1.0 and score(r, "no idea") == 0.0
    squad = [r for r in rows if r["task"] == "qa_1"]
    assert all(r["answers"] for r in squad)  # the unanswerable SQuAD v2 question is skipped, as RULER does
    assert len([r for r in rows if r["task"] == "qa_2"][0]["context"].split("Document ")) - 1 >= 4


def test_qa_tasks_from_the_hub_fail_clearly_offline(tok, monkeypatch):
    from kvcompress.datasets import DatasetUnavailable

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DatasetUnavailable, match="data_files"):
        load_dataset("ruler", tokenizer=tok, task="qa_1", context_tokens=512, num_samples=1)
    with pytest.raises(ConfigError, match="qa_files"):
        validate("ruler", {"task": "qa_1", "qa_files": {"qa_3": "x.jsonl"}})
