"""kvcompress.datasets: schema, seeding, sizing in model tokens, needle placement, loaders, scorers."""

import json
import math
import time
from pathlib import Path

import kvcompress  # noqa: F401  (first: preloads OpenBLAS before mlx)
import datasets
import pytest

from kvcompress.datasets import (
    DATASETS, DatasetUnavailable, dataset_params, load_dataset, max_answer_tokens, prompt_tokens,
    reference_tokens, score, validate,
)
from kvcompress.datasets import scorers
from kvcompress.datasets.niah import NEEDLE
from kvcompress.errors import ConfigError
from kvcompress.model import load_tokenizer

DATA = Path(__file__).parent / "data"
COLUMNS = ["id", "task", "context", "question", "answers", "context_tokens", "metadata"]
VARIANTS = ["single", "multikey", "multivalue", "multiquery"]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def meta(sample):
    return json.loads(sample["metadata"])


def build(name, tok, **params):
    return load_dataset(name, tokenizer=tok, **params)


# ------------------------------------------------------------------ schema, seeding, sizing


@pytest.mark.parametrize("name, params", [
    *[("niah", {"variant": v}) for v in VARIANTS], ("passkey", {}), ("lm", {}),
])
def test_schema_and_types(tok, name, params):
    ds = build(name, tok, context_tokens=512, num_samples=3, **params)
    assert isinstance(ds, datasets.Dataset)
    assert ds.column_names == COLUMNS
    assert ds.features["answers"] == datasets.List(datasets.Value("string"))
    assert ds.features["context_tokens"] == datasets.Value("int64")
    assert len(ds) == 3 and len(set(ds["id"])) == 3
    for sample in ds:
        assert all(isinstance(sample[c], str) for c in ("id", "task", "context", "question", "metadata"))
        assert sample["answers"] and all(isinstance(a, str) for a in sample["answers"])
        assert sample["context_tokens"] == len(prompt_tokens(sample, tok))
        assert isinstance(meta(sample), dict)


def test_default_tokenizer_is_the_embedded_models(tok):
    a = load_dataset("niah", context_tokens=512, num_samples=1)  # tokenizer=None
    b = build("niah", tok, context_tokens=512, num_samples=1)
    assert a.to_list() == b.to_list()


def test_kvcompress_load_dataset_is_this_one(tok):
    a = kvcompress.load_dataset("passkey", context_tokens=512, num_samples=1, seed=3)
    assert a.to_list() == build("passkey", tok, context_tokens=512, num_samples=1, seed=3).to_list()


@pytest.mark.parametrize("name, params", [("niah", {"variant": "multikey"}), ("passkey", {}), ("lm", {})])
def test_same_seed_same_dataset_other_seed_other_samples(tok, name, params):
    a = build(name, tok, context_tokens=512, num_samples=2, seed=1, **params).to_list()
    b = build(name, tok, context_tokens=512, num_samples=2, seed=1, **params).to_list()
    c = build(name, tok, context_tokens=512, num_samples=2, seed=2, **params).to_list()
    assert a == b
    for x, y in zip(a, c):
        assert x["context"] != y["context"]
        if name != "lm":
            assert x["answers"] != y["answers"]
    # sample i does not depend on how many samples were asked for
    assert build(name, tok, context_tokens=512, num_samples=1, seed=1, **params).to_list() == a[:1]


def test_niah_positions_differ_by_seed(tok):
    depths = {tuple(meta(s)["needle_depths"]) for seed in range(4)
              for s in build("niah", tok, variant="multivalue", context_tokens=512, num_samples=1, seed=seed)}
    assert len(depths) == 4


@pytest.mark.parametrize("target", [512, 1024, 2048])
@pytest.mark.parametrize("name, params", [("niah", {"variant": "single"}), ("niah", {"variant": "multiquery"}),
                                          ("passkey", {}), ("lm", {})])
def test_sized_in_model_tokens_within_2_percent(tok, name, params, target):
    ds = build(name, tok, context_tokens=target, num_samples=2, **params)
    for sample in ds:
        length = len(prompt_tokens(sample, tok))
        assert length == sample["context_tokens"]
        assert target * 0.98 <= length <= target


# ------------------------------------------------------------------ prompts


def test_qa_prompt_is_the_chat_template_instruction_context_question(tok):
    sample = build("niah", tok, context_tokens=512, num_samples=1)[0]
    text = tok.decode(prompt_tokens(sample, tok))
    assert text.startswith("<|im_start|>system")
    key = meta(sample)["keys"][0]  # RULER's answer prefix follows the generation prompt
    assert text.endswith(f"<|im_start|>assistant\n The special magic number for {key} mentioned in the provided text is")
    instruction = text.index("A special magic number is hidden")
    context = text.index(sample["context"][:200])
    question = text.index(sample["question"])
    assert instruction < context < question
    assert reference_tokens(sample, tok) is None


def test_lm_prompt_is_raw_text_and_reference_continues_it(tok):
    ds = build("lm", tok, context_tokens=1024, continuation_tokens=64, num_samples=2)
    for sample in ds:
        prompt, reference = prompt_tokens(sample, tok), reference_tokens(sample, tok)
        assert tok.decode(prompt) == sample["context"]
        assert prompt + reference == tok.encode(sample["context"] + sample["answers"][0])
        assert 60 <= len(reference) <= 64
        assert max_answer_tokens(sample) == len(reference)
        assert math.isnan(score(sample, "anything"))


# ------------------------------------------------------------------ needles


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_single_needle_at_requested_depth(tok, depth):
    for sample in build("niah", tok, context_tokens=1024, depth=depth, num_samples=2):
        info = meta(sample)
        needle = NEEDLE.format(key=info["asked"][0], value=sample["answers"][0])
        at = sample["context"].index(needle)
        assert at == info["needle_chars"][0]
        assert sample["context"].count(needle) == 1
        assert abs(at / len(sample["context"]) - depth) < 0.05


@pytest.mark.parametrize("depth", [0.0, 0.4, 1.0])
def test_passkey_at_requested_depth(tok, depth):
    for sample in build("passkey", tok, context_tokens=1024, depth=depth, num_samples=2):
        key = sample["answers"][0]
        assert len(key) == 5 and key.isdigit()
        line = f"The pass key is {key}. Remember it. {key} is the pass key."
        at = sample["context"].index(line)
        assert abs(at / len(sample["context"]) - depth) < 0.03
        assert sample["context"].replace(line, "").count(key) == 0
        assert "The grass is green. The sky is blue." in sample["context"]


def test_multikey_has_three_distractors_and_asks_one(tok):
    for sample in build("niah", tok, variant="multikey", context_tokens=1024, depth=0.3, num_samples=3):
        info = meta(sample)
        assert len(set(info["keys"])) == 4 and len(info["needles"]) == 4
        assert len(info["asked"]) == 1 and info["asked"][0] in sample["question"]
        for needle in info["needles"]:
            assert sample["context"].count(needle) == 1
        asked = [n for n in info["needles"] if f"for {info['asked'][0]} is:" in n]
        assert len(asked) == 1 and asked[0].endswith(f"is: {sample['answers'][0]}.")
        distractor_values = [n.split("is: ")[1][:-1] for n in info["needles"] if n not in asked]
        assert len(distractor_values) == 3 and sample["answers"][0] not in distractor_values
        assert abs(sample["context"].index(asked[0]) / len(sample["context"]) - 0.3) < 0.05
        assert max_answer_tokens(sample) == 128  # RULER's niah tokens_to_generate
        assert score(sample, f"The number is {distractor_values[0]}.") == 0.0
        assert score(sample, f"The number is {sample['answers'][0]}.") == 1.0


def test_multivalue_and_multiquery_answers(tok):
    mv = build("niah", tok, variant="multivalue", context_tokens=1024, num_samples=1)[0]
    info = meta(mv)
    assert len(info["keys"]) == 1 and len(mv["answers"]) == 4 and len(set(mv["answers"])) == 4
    assert all(f"for {info['keys'][0]} is: {v}." in mv["context"] for v in mv["answers"])
    assert mv["question"].startswith("What are all the special magic numbers for")
    assert score(mv, " ".join(mv["answers"][:3])) == 0.75

    mq = build("niah", tok, variant="multiquery", context_tokens=1024, num_samples=1)[0]
    info = meta(mq)
    assert len(info["asked"]) == 4 and all(k in mq["question"] for k in info["asked"])
    for key, value in zip(info["asked"], mq["answers"]):
        assert f"for {key} is: {value}." in mq["context"]
    assert max_answer_tokens(mq) == 128


def test_passkey_score_and_answer_length(tok):
    sample = build("passkey", tok, context_tokens=512, num_samples=1)[0]
    key = sample["answers"][0]
    assert score(sample, f"The pass key is {key}. Remember it.") == 1.0
    assert score(sample, f"The pass key is {int(key) + 1}. {key}") == 0.0
    assert max_answer_tokens(sample) == 8


def test_passkey_prompt_is_landmarks_raw_text_ending_in_the_completion_cue(tok):
    sample = build("passkey", tok, context_tokens=512, num_samples=1)[0]
    text = tok.decode(prompt_tokens(sample, tok))
    assert "<|im_start|>" not in text  # no chat template: it breaks the cue (docs/datasets.md)
    assert text.startswith("There is an important info hidden inside a lot of irrelevant text.")
    assert text.endswith("What is the pass key? The pass key is")


# ------------------------------------------------------------------ hub-form loaders on local files


def test_longbench_from_local_jsonl_truncates_in_the_middle(tok):
    ds = build("longbench", tok, subset="narrativeqa", context_tokens=512,
               data_files=str(DATA / "longbench_narrativeqa.jsonl"))
    assert ds.column_names == COLUMNS and len(ds) == 3
    raw = [json.loads(line) for line in (DATA / "longbench_narrativeqa.jsonl").read_text().splitlines()]
    long_sample, _, short_sample = ds
    assert long_sample["id"] == "longbench-narrativeqa-lb-nqa-0001"
    assert long_sample["task"] == "narrativeqa" and long_sample["answers"] == ["Kestrel Point", "at Kestrel Point"]
    assert meta(long_sample)["truncated"] is True and meta(short_sample)["truncated"] is False
    assert 0.98 * 512 <= len(prompt_tokens(long_sample, tok)) == long_sample["context_tokens"] <= 512
    # LongBench keeps the head and the tail: the opening sentence and the ending both survive
    assert long_sample["context"].startswith(raw[0]["context"][:80])
    assert long_sample["context"].endswith(raw[0]["context"][-80:])
    assert len(long_sample["context"]) < len(raw[0]["context"]) / 2
    assert short_sample["context"] == raw[2]["context"]
    text = tok.decode(prompt_tokens(long_sample, tok))
    assert text.startswith("<|im_start|>system") and "Question: Where did Marta keep the lighthouse?" in text
    assert max_answer_tokens(long_sample) == 128
    assert score(long_sample, "At Kestrel Point.") == 1.0
    assert score(long_sample, "Kestrel") == pytest.approx(2 / 3)  # best of 2/3 and 1/2


def test_longbench_parquet_equals_jsonl_and_subsets_are_seeded(tok, tmp_path):
    import pyarrow.json

    parquet = tmp_path / "0000.parquet"
    import pyarrow.parquet as pq

    pq.write_table(pyarrow.json.read_json(DATA / "longbench_narrativeqa.jsonl"), parquet)
    a = build("longbench", tok, context_tokens=512, data_files=str(DATA / "longbench_narrativeqa.jsonl"))
    b = build("longbench", tok, context_tokens=512, data_files=str(parquet))
    assert a.to_list() == b.to_list()
    two = build("longbench", tok, context_tokens=512, num_samples=2, seed=5,
                data_files=str(DATA / "longbench_narrativeqa.jsonl"))
    again = build("longbench", tok, context_tokens=512, num_samples=2, seed=5,
                  data_files=str(DATA / "longbench_narrativeqa.jsonl"))
    assert len(two) == 2 and two.to_list() == again.to_list()
    assert set(two["id"]) <= set(a["id"])


def test_longbench_trec_is_raw_few_shot_and_scored_by_class(tok):
    ds = build("longbench", tok, subset="trec", context_tokens=2048, data_files=str(DATA / "longbench_trec.jsonl"))
    sample = ds[0]
    text = tok.decode(prompt_tokens(sample, tok))
    assert text.startswith("Please determine the type of the question below.")  # no chat template
    assert text.endswith("Question: Who painted the Mona Lisa ?\nType:")
    assert score(sample, "Human being\nQuestion: What is x ?") == 1.0  # first line only, as LongBench
    assert score(sample, "Location or Human being") == 0.5
    assert score(sample, "Entity") == 0.0
    assert max_answer_tokens(sample) == 64


def test_longbench_hub_form_fails_clearly_offline(tok, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    start = time.perf_counter()
    with pytest.raises(DatasetUnavailable, match="data_files") as err:
        build("longbench", tok, subset="qasper", num_samples=1)
    assert "THUDM/LongBench" in str(err.value) and "refs/convert/parquet" in str(err.value)
    assert "HF_HUB_OFFLINE" in str(err.value)
    assert time.perf_counter() - start < 20


def test_hf_column_mapping_on_local_json(tok):
    ds = build("hf", tok, path="json", data_files=str(DATA / "hf_squad_like.jsonl"), context_tokens=256,
               columns={"context": "passage", "question": "query", "answers": "answers", "id": "uid"})
    assert ds.column_names == COLUMNS and ds["id"] == ["sq-1", "sq-2", "sq-3"]
    assert ds["task"] == ["qa"] * 3
    assert ds[0]["answers"] == ["the North Sea", "North Sea"] and ds[1]["answers"] == ["1843"]
    assert ds[0]["question"] == "Which sea does the Rhine flow into?"
    long_row = ds[2]
    assert meta(long_row)["truncated"] is True
    assert 0.98 * 256 <= long_row["context_tokens"] == len(prompt_tokens(long_row, tok)) <= 256
    assert long_row["context"].endswith("The code word is heliotrope.")
    assert score(ds[0], "North Sea") == 1.0
    assert score(ds[1], "It was published in 1843.") == pytest.approx(1 / 3)  # P = 1/5, R = 1
    with pytest.raises(ConfigError, match=r"columns\['context'\]"):
        build("hf", tok, path="json", data_files=str(DATA / "hf_squad_like.jsonl"), columns={"answers": "answers"})


def test_hf_task_picks_the_scorer(tok):
    ds = build("hf", tok, path="json", data_files=str(DATA / "longbench_trec.jsonl"), task="string_match",
               columns={"question": "input"}, num_samples=1)
    sample = ds[0]
    assert sample["task"] == "string_match" and sample["answers"][0] in ("Human being", "Numeric value")
    assert score(sample, f"it is a {sample['answers'][0].lower()}") == 1.0
    assert score(sample, "Abbreviation") == 0.0


# ------------------------------------------------------------------ validation


@pytest.mark.parametrize("name, params, field", [
    ("niah", {"variant": "double"}, "variant"),
    ("niah", {"depth": 1.5}, "depth"),
    ("niah", {"depth": -0.1}, "depth"),
    ("niah", {"depth": "middle"}, "depth"),
    ("passkey", {"depth": True}, "depth"),
    ("niah", {"context_tokens": 0}, "context_tokens"),
    ("niah", {"context_tokens": 128}, "context_tokens"),
    ("passkey", {"context_tokens": 1024.0}, "context_tokens"),
    ("lm", {"context_tokens": "1k"}, "context_tokens"),
    ("lm", {"continuation_tokens": 0}, "continuation_tokens"),
    ("niah", {"num_samples": 0}, "num_samples"),
    ("niah", {"num_samples": None}, "num_samples"),
    ("passkey", {"seed": 1.5}, "seed"),
    ("niah", {"needles": 3}, "needles"),
    ("longbench", {"subset": "narrative_qa"}, "subset"),
    ("longbench", {"data_files": 3}, "data_files"),
    ("hf", {}, "path"),
    ("hf", {"path": "json", "task": "poetry"}, "task"),
    ("hf", {"path": "json", "columns": {"text": "body"}}, "columns"),
    ("nosuch", {}, "dataset"),
])
def test_bad_parameters_raise_config_error_naming_the_field(name, params, field):
    with pytest.raises(ConfigError) as err:
        validate(name, params)
    assert str(err.value).startswith((f"{field}:", f"{name}.{field}:"))  # unknown ones: name.field
    with pytest.raises(ConfigError):
        load_dataset(name, **params)


def test_validate_does_no_work():
    start = time.perf_counter()
    validate("longbench", {"subset": "qasper", "context_tokens": 4096, "num_samples": 10, "seed": 0})
    validate("hf", {"path": "no-such/dataset", "task": "qa"})
    validate("niah", {"variant": "multiquery", "context_tokens": 131072, "depth": 0.5, "num_samples": 1000})
    # doing the work (1000 needles at 131k tokens, a hub request) takes far more than this even on an
    # idle machine; the bound leaves room for a busy one
    assert time.perf_counter() - start < 2


def test_dataset_params_defaults():
    assert set(DATASETS) == {"niah", "ruler", "passkey", "lm", "longbench", "hf"}
    assert dataset_params("niah") == {"variant": "single", "context_tokens": 1024, "depth": None,
                                      "num_samples": 4, "seed": 0}
    assert dataset_params("lm")["continuation_tokens"] == 64
    assert dataset_params("longbench")["revision"] == "refs/convert/parquet"
    assert dataset_params("hf")["columns"] == {} and dataset_params("hf")["path"] is None
    for name in DATASETS:
        assert {"context_tokens", "num_samples", "seed"} <= set(dataset_params(name))
    with pytest.raises(ConfigError, match="dataset"):
        dataset_params("nosuch")


# ------------------------------------------------------------------ scorers on worked examples


def test_string_match_all():
    assert scorers.string_match_all("The numbers are 1234567 and 7654321.", ["1234567", "7654321", "1111111"]) \
        == pytest.approx(2 / 3)
    assert scorers.string_match_all("ANSWER: Paris", ["paris"]) == 1.0
    assert scorers.string_match_all("", ["1"]) == 0.0


def test_passkey_match():
    assert scorers.passkey_match("The pass key is 46398. Remember it.", "46398") == 1.0
    assert scorers.passkey_match("It is 4639, no, 46398", "46398") == 0.0  # the first number counts
    assert scorers.passkey_match("463980", "46398") == 0.0
    assert scorers.passkey_match("no digits", "46398") == 0.0


def test_qa_f1():
    assert scorers.normalize_answer("The  North-Sea, an ocean!") == "northsea ocean"
    assert scorers.qa_f1("The North Sea.", "north sea") == 1.0
    # pred [in, north, sea, basin] vs ref [north, sea]: P = 2/4, R = 2/2, F1 = 2/3
    assert scorers.qa_f1("in the North Sea basin", "the North Sea") == pytest.approx(2 / 3)
    assert scorers.qa_f1("Atlantic", "North Sea") == 0.0
    # hf sample 2: pred [it, was, published, in, 1843] vs [1843]: P = 1/5, R = 1, F1 = 1/3
    assert scorers.qa_f1("It was published in 1843.", "1843") == pytest.approx(1 / 3)


def test_rouge_l():
    assert scorers.lcs_length(list("ABCBDAB"), list("BDCABA")) == 4
    # LCS "the cat on the mat" = 5 of 6 tokens each way
    assert scorers.rouge_l("the cat sat on the mat", "the cat is on the mat") == pytest.approx(5 / 6)
    # periods split and vanish, case is kept: [A, b, C, d] vs [a, b, c, d] share [b, d]
    assert scorers.rouge_l("A b. C d.", "a b c d") == pytest.approx(0.5)
    # pred 2 tokens, ref 4, LCS 2: P = 1, R = 1/2, F = 2/3
    assert scorers.rouge_l("quick fox", "the quick brown fox") == pytest.approx(2 / 3)
    assert scorers.rouge_l("", "anything") == 0.0


def test_classification():
    classes = ["Abbreviation", "Entity", "Description", "Human being", "Location", "Numeric value"]
    assert scorers.classification("Type: Human being", "Human being", classes) == 1.0
    assert scorers.classification("Location or Human being", "Human being", classes) == 0.5
    assert scorers.classification("Entity", "Human being", classes) == 0.0
    # a class name inside the reference is not held against it
    assert scorers.classification("Human being", "Human being", ["Human", "Human being"]) == 1.0


def test_retrieval_count_code_sim():
    assert scorers.retrieval("Paragraph 12", "Paragraph 12") == 1.0
    assert scorers.retrieval("Paragraph 3 or Paragraph 12", "Paragraph 12") == 0.5
    assert scorers.retrieval("I do not know", "Paragraph 12") == 0.0
    assert scorers.count("There are 7 unique paragraphs", "7") == 1.0
    assert scorers.count("7 or 8 or 9", "7") == pytest.approx(1 / 3)
    assert scorers.code_sim("```python\n    return x + 1\n```", "    return x + 1") == 1.0
    # "return x+1" vs "return x + 1": matches "return x", "+", "1" = 10 chars; 2*10/22 = 90.9% -> 0.91
    assert scorers.code_sim("# add one\nreturn x+1", "return x + 1") == 0.91
