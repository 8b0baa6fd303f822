"""Built-in tasks, mixture, JSONL loading and answer extraction (mrl_jax.tasks)."""
import json

import numpy as np
import pytest

from mrl_jax.tasks import (
    ARITH_OPS,
    STRING_OPS,
    ArithmeticTask,
    FactTableTask,
    JsonlFormatError,
    JsonlTask,
    MixtureTask,
    Prompt,
    StringTask,
    answers_match,
    default_mixture,
    extract_answer,
    extract_boxed,
    extract_hash,
    extract_last_number,
    filter_prompts,
    load_jsonl,
    parse_number,
)

INT32_MAX = 2**31 - 1


def _all_generated_tasks(seed=0):
    tasks = [ArithmeticTask(op, d, seed=seed) for op in ARITH_OPS for d in (1, 2, 3, 4)]
    tasks += [StringTask(op, n_train=300, n_eval=50, seed=seed) for op in STRING_OPS]
    return tasks


def _key(prompts):
    return [(p.id, p.text, p.answer, p.task) for p in prompts]


# ------------------------------------------------------------------------------ generators
def test_generators_deterministic_and_seed_dependent():
    for t1, t2, t3 in zip(_all_generated_tasks(0), _all_generated_tasks(0), _all_generated_tasks(1)):
        assert _key(t1.train_prompts()) == _key(t2.train_prompts()), t1.name
        assert _key(t1.eval_prompts()) == _key(t2.eval_prompts()), t1.name
        assert [p.text for p in t1.train_prompts()] != [p.text for p in t3.train_prompts()], t1.name
    f1, f2, f3 = FactTableTask(seed=0), FactTableTask(seed=0), FactTableTask(seed=1)
    assert f1.table() == f2.table() and f1.table() != f3.table()
    assert [p.meta["part"] for p in f1.train_prompts()] == [p.meta["part"] for p in f2.train_prompts()]


def test_train_and_heldout_disjoint():
    for t in _all_generated_tasks() + [FactTableTask(heldout_fraction=0.25)]:
        tr, ev = t.train_prompts(), t.eval_prompts()
        assert t.heldout_disjoint
        assert len(tr) > 0 and len(ev) > 0, t.name
        assert not {p.text for p in tr} & {p.text for p in ev}, t.name
        assert not {p.id for p in tr} & {p.id for p in ev}, t.name
        assert len({p.text for p in tr + ev}) == len(tr) + len(ev), f"duplicate prompts in {t.name}"
        assert {p.meta["split"] for p in tr} == {"train"} and {p.meta["split"] for p in ev} == {"eval"}


def test_arith_answers_correct_short_and_digits():
    for t in _all_generated_tasks()[:12]:
        sym = {"add": "+", "sub": "-", "mul": "*"}[t.op]
        for p in t.train_prompts() + t.eval_prompts():
            a, b = p.meta["a"], p.meta["b"]
            assert p.text == f"{t.op}:{a}{sym}{b}="
            assert p.answer == str(eval(f"{a}{sym}{b}"))
            assert len(p.answer) <= 12 and not p.answer.startswith("-")
            if t.digits > 1:
                assert len(str(a)) == len(str(b)) == t.digits


def test_string_ops_hand_examples():
    assert StringTask("rev").answer_for("abc") == "cba"
    assert StringTask("sort").answer_for("cab") == "abc"
    assert StringTask("count").answer_for("abca", "a") == "2"
    assert StringTask("cnt").answer_for("abca", "h") == "0"
    assert StringTask("copy").answer_for("abc") == "abc"
    assert StringTask("shift").answer_for("abh") == "bca"
    t = StringTask("cnt", n_train=200, n_eval=20)
    for p in t.train_prompts():
        char, s = p.text[len("cnt:"):-1].split(":")
        assert p.answer == str(s.count(char))
    assert {p.answer for p in t.train_prompts()} >= {"0", "1"}


def test_ids_unique_stable_int32_across_default_mixture():
    m = default_mixture(seed=0)
    prompts = m.train_prompts() + m.eval_prompts()
    ids = [p.id for p in prompts]
    assert all(0 <= i <= INT32_MAX for i in ids)
    fact = m.by_name["fact"]
    others = [p for p in prompts if p.task != "fact"]
    assert len({p.id for p in others}) == len(others)
    assert {p.id for p in prompts if p.task == "fact"} == {p.id for p in fact.train_prompts()}
    assert _key(default_mixture(seed=0).train_prompts()) == _key(m.train_prompts())
    assert m.prompt(ids[0]) == prompts[0]
    # every prompt carries its task token
    for p in prompts:
        assert p.text.split(":", 1)[0] in {"add", "rev", "copy", "fact"}
        assert len(p.answer) <= 12


def test_mixture_rejects_id_collision_and_duplicate_names():
    with pytest.raises(ValueError, match="duplicate task names"):
        MixtureTask([ArithmeticTask("add", 1), ArithmeticTask("add", 1)])
    m = MixtureTask([ArithmeticTask("add", 1), ArithmeticTask("add", 1, name="other")])
    with pytest.raises(ValueError, match="id_base"):
        m.train_prompts()


# ----------------------------------------------------------------------------- verifiers
def test_exact_verifiers_on_hand_examples():
    t = ArithmeticTask("add", 2)
    p = Prompt(id=1, text="add:12+7=", answer="19", task=t.name)
    assert t.verify(p, "19") == 1.0
    assert t.verify(p, "  19 \n") == 1.0  # surrounding whitespace is fine
    for wrong in ["18", "1", "190", "1 9", "", "19.0 ", "x19", "019"]:
        assert t.verify(p, wrong) == 0.0, wrong
    s = StringTask("rev")
    q = Prompt(id=2, text="rev:abc=", answer="cba", task="rev")
    assert s.verify(q, "cba") == 1.0 and s.verify(q, "\tcba\n") == 1.0
    assert s.verify(q, "cb") == 0.0 and s.verify(q, "abc") == 0.0 and s.verify(q, "cbaa") == 0.0


def test_fact_table_parts_values_and_verify():
    f = FactTableTask(num_keys=32, seed=3)
    table = f.table()
    assert len(table) == 32 and len(set(table.values())) == 32  # distinct values
    tr = f.train_prompts()
    assert f.eval_prompts() == tr and not f.heldout_disjoint  # the held-out set is the table itself
    a, b = filter_prompts(tr, part="A"), filter_prompts(tr, part="B")
    assert len(a) == len(b) == 16 and not {p.id for p in a} & {p.id for p in b}
    sa, sb = f.sft_examples("A"), f.sft_examples("B")
    assert {s.prompt for s in sa} == {p.text for p in a} and {s.prompt for s in sb} == {p.text for p in b}
    p = a[0]
    assert p.text == f"fact:{p.meta['key']}=" and f.verify(p, table[p.meta["key"]]) == 1.0
    assert f.verify(p, b[0].answer) == 0.0  # a value of the other part is always wrong
    with pytest.raises(ValueError, match="no part"):
        f.sft_examples("C")
    # a held-out split keeps the held-out keys in the SFT pairs
    h = FactTableTask(num_keys=32, heldout_fraction=0.25)
    assert len(h.eval_prompts()) == 8 and len(h.sft_examples("A")) == 16


def test_mixture_dispatch_parts_and_sampling():
    m = default_mixture(seed=0)
    assert m.parts == ("A", "B")
    for p in m.eval_prompts()[:: 7]:
        assert m.verify(p, p.answer) == 1.0 and m.verify(p, p.answer + "x") == 0.0
    sa, sb = m.sft_examples("A"), m.sft_examples("B")
    fa = {s.prompt for s in sa if s.prompt.startswith("fact:")}
    fb = {s.prompt for s in sb if s.prompt.startswith("fact:")}
    assert len(fa) == len(fb) == 16 and not fa & fb
    assert {s for s in sa if not s.prompt.startswith("fact:")} == {s for s in sb if not s.prompt.startswith("fact:")}
    rng = np.random.default_rng(0)
    sample = m.sample_train(4000, rng)
    frac_fact = np.mean([p.task == "fact" for p in sample])
    assert 0.45 < frac_fact < 0.55  # weights [1, 1, 1, 3]
    sft = m.sample_sft(2000, rng, part="B")
    assert all(s.prompt in fb for s in sft if s.prompt.startswith("fact:"))
    # disjoint-skills setup: un-partitioned tasks chosen per part
    m2 = MixtureTask([StringTask("rev", n_train=50, n_eval=5), StringTask("copy", n_train=50, n_eval=5)],
                     part_tasks={"A": ["rev"], "B": ["copy"]})
    assert {s.prompt.split(":")[0] for s in m2.sft_examples("A")} == {"rev"}


# ------------------------------------------------------------------------- answer extraction
def test_answer_extraction_formats():
    assert extract_hash("so 3 + 4 = 7\n#### 7") == "7"
    assert extract_hash("#### 1 \n#### 1,000\nmore") == "1,000"
    assert extract_hash("no marker 5") is None
    assert extract_boxed(r"thus \boxed{42}.") == "42"
    assert extract_boxed(r"\boxed{\frac{1}{2}}") == r"\frac{1}{2}"  # nested braces
    assert extract_boxed(r"\boxed{a{b{c}}d} then \boxed{ {x}^{2} }") == "{x}^{2}"  # the last one
    assert extract_boxed(r"\boxed{unclosed {") is None
    assert extract_last_number("I have 3 apples, 12 pears and -1,234.5 debt.") == "-1,234.5"
    assert extract_last_number("no digits") is None
    assert extract_answer(r"x=\boxed{5} so #### 6") == "6"  # hash first by default
    assert extract_answer(r"the answer is \boxed{5}, not 7") == "5"
    assert extract_answer("it is 17 or 18") == "18"
    assert extract_answer("it is 17", formats=("boxed",)) is None


def test_numeric_comparison_tolerant_of_formatting():
    assert parse_number("1,000") == 1000 and parse_number(" $1,000.50 ") == 1000.5
    assert parse_number("3.0") == 3 and parse_number(r"\frac{3}{4}") == 0.75 and parse_number("3/4") == 0.75
    assert parse_number("1,00") is None and parse_number("abc") is None and parse_number("") is None
    assert answers_match("1,000", "1000") and answers_match("3.0", "3") and answers_match("50%", "50")
    assert answers_match(r"\dfrac{1}{2}", "0.5") and answers_match("72 clips", "72")
    assert not answers_match("1001", "1000") and not answers_match(None, "1")
    assert answers_match(" Paris. ", "Paris") and not answers_match("Lyon", "Paris")


# ------------------------------------------------------------------------------------ JSONL
def _write(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_jsonl_task_fields_split_and_verify(tmp_path):
    recs = [{"question": f"What is {i} times 20?", "solution": f"{i}*20={20 * i}\n#### {20 * i:,}"}
            for i in range(400)]
    lines = [json.dumps(r) for r in recs]
    lines.insert(5, "   ")  # blank lines are skipped
    path = _write(tmp_path / "data.jsonl", lines)
    t = JsonlTask(path, prompt_field="question", answer_field="solution", heldout_fraction=0.2, seed=1)
    tr, ev = t.train_prompts(), t.eval_prompts()
    assert len(tr) + len(ev) == 400 and 40 < len(ev) < 120
    assert not {p.text for p in tr} & {p.text for p in ev} and not {p.id for p in tr} & {p.id for p in ev}
    again = JsonlTask(path, prompt_field="question", answer_field="solution", heldout_fraction=0.2, seed=1)
    assert _key(again.eval_prompts()) == _key(ev)
    other = JsonlTask(path, prompt_field="question", answer_field="solution", heldout_fraction=0.2, seed=2)
    assert {p.text for p in other.eval_prompts()} != {p.text for p in ev}
    for p in tr[:20] + ev[:5]:
        n = 20 * int(p.text.split()[2])
        assert parse_number(p.answer) == n and p.meta["raw_answer"].endswith(f"#### {n:,}")
        assert t.verify(p, f"... so the total is {n:,}") == 1.0
        assert t.verify(p, f"... so the total is {n}") == 1.0
        assert t.verify(p, rf"\boxed{{{n}.0}}") == 1.0
        assert t.verify(p, f"#### {n + 1}") == 0.0 and t.verify(p, "no idea") == 0.0
    assert t.sft_examples()[0].answer.count("####") == 1  # full solutions for SFT


def test_jsonl_bad_lines_name_file_and_line(tmp_path):
    good = json.dumps({"prompt": "p", "answer": "1"})
    cases = {
        "invalid JSON": [good, good, '{"prompt": "p", "answer": '],
        "missing field 'answer'": [good, json.dumps({"prompt": "p", "ans": "1"}), good],
        "expected a JSON object": [good, "[1, 2]"],
        "must be a string or a number": [good, good, good, json.dumps({"prompt": ["x"], "answer": "1"})],
    }
    expected_line = {"invalid JSON": 3, "missing field 'answer'": 2, "expected a JSON object": 2,
                     "must be a string or a number": 4}
    for what, lines in cases.items():
        path = _write(tmp_path / "bad.jsonl", lines)
        with pytest.raises(JsonlFormatError) as ei:
            load_jsonl(path)
        msg = str(ei.value)
        assert f"{path}:{expected_line[what]}:" in msg and what in msg, msg
    path = _write(tmp_path / "ids.jsonl", [json.dumps({"prompt": "a", "answer": 1, "k": 7}),
                                           json.dumps({"prompt": "b", "answer": 2.0, "k": 7})])
    rows = load_jsonl(path, id_field="k")
    assert [r["answer"] for r in rows] == ["1", "2"]
    with pytest.raises(JsonlFormatError, match=r"ids\.jsonl:2: duplicate id 7"):
        JsonlTask(path, id_field="k").train_prompts()
    empty = _write(tmp_path / "empty.jsonl", [""])
    with pytest.raises(ValueError, match="empty"):
        load_jsonl(empty)


def test_mixture_sft_draws_build_their_pools_once_per_part(monkeypatch):
    """A warm start draws thousands of batches: the component tasks' example lists are built once per part (they
    were rebuilt for every batch), and the draws are the weighted two-stage draw."""
    copy, rev = StringTask("copy", n_train=40, n_eval=4), StringTask("rev", n_train=40, n_eval=4)
    m = MixtureTask([copy, rev], weights=[3, 1])
    calls = {"n": 0}
    real = StringTask.sft_examples

    def counted(self, part=None):
        calls["n"] += 1
        return real(self, part)

    monkeypatch.setattr(StringTask, "sft_examples", counted)
    rng = np.random.default_rng(0)
    draws = [m.sample_sft(8, rng) for _ in range(300)]
    assert calls["n"] == 2   # one per component task, not 2 x 300
    frac_copy = np.mean([s.prompt.startswith("copy:") for d in draws for s in d])
    assert abs(frac_copy - 0.75) < 0.03
    with pytest.raises(ValueError, match="no part 'Z'"):
        m.sample_sft(2, rng, part="Z")
