"""``/v1/rerank``, ``/v2/rerank`` and ``/v1/score`` on a live server: each score is the
model's p(yes) / (p(yes) + p(no)) after the rerank template, equal to what transformers
computes from the same prompt; documents come back ordered, ``top_n`` honoured; bad input
is a 400 naming the field."""

from __future__ import annotations

import httpx
import pytest
import torch

from tests.api.server_helpers import InProcessServer

pytestmark = pytest.mark.slow  # starts a server

DOCS = ["Paris is the capital of France.", "The fox jumps.", "Numbers 0123.", "café naïve"]
QUERY = "What is the capital of France?"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny model whose vocabulary has "yes" and "no" as tokens of their own."""
    from tests.api.console_helpers import build_chain_model

    return build_chain_model(tmp_path_factory.mktemp("reranker") / "m", "!x", ["yes", "no"])


@pytest.fixture(scope="module")
def server(model):
    srv = InProcessServer(
        "--model", str(model), "--dtype", "float32", "--enable-rerank", "--max-prompts-per-request", "8"
    )  # fmt: skip
    yield srv
    srv.stop()


def _reference(model, pairs: list[tuple[str, str]]) -> list[float]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from radixserve.api.openai.rerank import DEFAULT_INSTRUCTION, RERANK_TEMPLATES

    tok = AutoTokenizer.from_pretrained(str(model))
    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")
    out = []
    for query, doc in pairs:
        text = RERANK_TEMPLATES["qwen3"].format(
            query=query, document=doc, instruction=DEFAULT_INSTRUCTION
        )
        ids = tok.encode(text, add_special_tokens=False)
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1].double()
        out.append(float(torch.softmax(logits[[yes, no]], 0)[0]))
    return out


def test_rerank_scores_are_the_models_yes_probability_in_order(server, model):
    r = httpx.post(
        server.url + "/v1/rerank",
        json={"query": QUERY, "documents": DOCS, "top_n": 3},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    expected = _reference(model, [(QUERY, d) for d in DOCS])
    results = body["results"]
    # ordered by score, the top 3 of the 4; where the reference's scores tie (this tiny
    # model can give "yes" and "no" the same logit), float32 rounding may order them either way
    scores = [x["relevance_score"] for x in results]
    assert len(results) == 3 and scores == sorted(scores, reverse=True)
    assert min(scores) >= sorted(expected, reverse=True)[2] - 1e-4
    for x in results:
        assert x["relevance_score"] == pytest.approx(expected[x["index"]], abs=1e-4)
        assert x["document"] == {"text": DOCS[x["index"]]}
    assert body["usage"]["total_tokens"] > 0
    # Cohere's shape (v2), documents as objects, without the texts back; then vLLM's score
    v2 = httpx.post(
        server.url + "/v2/rerank",
        json={"query": QUERY, "documents": [{"text": d} for d in DOCS], "return_documents": False},
        timeout=60,
    ).json()
    assert [x["relevance_score"] for x in v2["results"]][:3] == pytest.approx(scores, abs=1e-4)
    for x in v2["results"]:  # ties may come back in either order (see above)
        assert x["relevance_score"] == pytest.approx(expected[x["index"]], abs=1e-4)
    assert all("document" not in x for x in v2["results"])
    score = httpx.post(
        server.url + "/v1/score", json={"text_1": QUERY, "text_2": DOCS}, timeout=60
    ).json()
    assert [d["score"] for d in score["data"]] == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"query": QUERY, "documents": []}, "documents"),
        ({"query": "  ", "documents": DOCS}, "query"),
        ({"query": QUERY, "documents": DOCS, "top_n": 0}, "top_n"),
        ({"query": QUERY, "documents": DOCS * 3}, "documents"),  # over --max-prompts-per-request
        ({"query": QUERY, "documents": [{"txt": "x"}]}, "documents.0"),
        ({"query": QUERY, "documents": DOCS, "nonsense": 1}, "nonsense"),
    ],
)
def test_bad_rerank_input_is_a_400_naming_the_field(server, body, param):
    r = httpx.post(server.url + "/v1/rerank", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_template_file_may_hold_other_braces(tmp_path):
    from radixserve.api.openai.rerank import fill_template, rerank_template

    path = tmp_path / "t.txt"
    path.write_text('Answer {"yes"|"no"}. {instruction}\nQ: {query}\nD: {document}\n')
    template = rerank_template(str(path))
    assert fill_template(template, "q?", "doc {x}", "Judge.") == (
        'Answer {"yes"|"no"}. Judge.\nQ: q?\nD: doc {x}\n'
    )
    with pytest.raises(ValueError, match="neither a template name"):
        rerank_template(str(tmp_path / "missing"))
