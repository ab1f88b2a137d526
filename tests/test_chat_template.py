"""Chat templates are untrusted code: ordinary templates render as before, hostile ones fail
fast with a TemplateBudgetError that names the bound they hit (no timing: bounds are counts)."""

import pytest

from forerun.models import chat_template
from forerun.models.chat_template import TemplateBudgetError, compile_template, render
from forerun.models.tokenizer import TextTokenizer

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_ordinary_template_features_still_render():
    source = (CHATML + "{% set ns = namespace(n=0) %}{% for m in messages %}"
              "{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}|{{ messages|tojson }}|"
              "{{ messages|map(attribute='role')|join(',') }}|{{ 'a' ~ bos_token ~ 'b' }}|"
              "{{ '%3d' % 7 }}|{{ '{:>3}'.format('x') }}|{{ 'ab'|replace('a', 'c') }}|"
              "{{ '-' * 3 }}|{% for m in messages %}{{ loop.index }}/{{ loop.length }}"
              "{% endfor %}")
    out = render(compile_template(source), messages=MESSAGES, add_generation_prompt=True,
                 bos_token="<s>")
    head = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
            "<|im_start|>assistant\n")
    assert out == head + ('2|[{"role": "system", "content": "Be brief."}, {"role": "user", '
                          '"content": "hi"}]|system,user|a<s>b|  7|  x|cb|---|1/22/2')


HOSTILE = {
    "nested loops": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                     "{% endfor %}", "loop iterations"),
    "recursive loop": ("{% for x in [1] recursive %}{% if loop.depth < 4 %}"
                       "{{ loop(range(1000)) }}{% endif %}{% endfor %}", "loop iterations"),
    "string multiplication": ("{{ 'a' * 10**10 }}", "repetition of 10000000000"),
    "list multiplication": ("{{ ([1] * 100000) * 100000 }}", "repetition"),
    "power": ("{{ 7 ** 100000 }}", "number of bits"),
    "%-format width": ("{{ '%01000000000d' % 1 }}", "formatted field"),
    "%-format star": ("{{ '%*d' % (1000000000, 1) }}", "something sized"),
    "str.format width": ("{{ '{:>1000000000}'.format(1) }}", "formatted field"),
    "center filter": ("{{ 'a'|center(1000000000) }}", "something sized"),
    "center method": ("{{ 'a'.center(1000000000) }}", "something sized"),
    "replace": ("{% set a = 'a' * 4000000 %}{{ a|replace('a', a) }}", "a string"),
    "join": ("{% set a = 'a' * 4000000 %}{{ ([a] * 1000)|join }}", "a string"),
    "~ doubling": ("{% set a = 'a' * 3000000 %}{% set a = a ~ a %}{{ a }}", "a string"),
    "namespace doubling": ("{% set ns = namespace(s='ab') %}{% for i in range(40) %}"
                           "{% set ns.s = ns.s + ns.s %}{% endfor %}", "concatenation"),
    "indent": ("{{ ('a\\n' * 1000000)|indent('b' * 1000000) }}", "a string"),
    "output": ("{% for i in range(100000) %}{{ 'a' * 100 }}{% endfor %}", "wrote over"),
}


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_template_fails_within_its_bound(name, monkeypatch):
    # counts, not the clock: a smaller loop budget (quicker) and a deadline out of reach, so
    # that a loaded machine cannot turn "loop iterations" into "ran over 5.0 s"
    monkeypatch.setattr(chat_template, "MAX_LOOP_STEPS", 50_000)
    monkeypatch.setattr(chat_template, "RENDER_DEADLINE_S", 3600.0)
    source, message = HOSTILE[name]
    with pytest.raises(TemplateBudgetError, match=message):
        render(compile_template(source), messages=MESSAGES)


def test_loop_budget_counts_every_iteration_and_the_deadline(monkeypatch):
    loops = "{% for i in range(10) %}{% for j in range(10) %}.{% endfor %}{% endfor %}"
    monkeypatch.setattr(chat_template, "MAX_LOOP_STEPS", 110)  # 10 + 100 iterations
    assert render(compile_template(loops)) == "." * 100
    monkeypatch.setattr(chat_template, "MAX_LOOP_STEPS", 109)
    with pytest.raises(TemplateBudgetError, match="109 loop iterations"):
        render(compile_template(loops))
    monkeypatch.setattr(chat_template, "RENDER_DEADLINE_S", -1.0)  # past at the first step
    with pytest.raises(TemplateBudgetError, match=r"ran over -1\.0 s"):
        render(compile_template(loops))


def test_tokenizer_renders_through_the_bounded_sandbox():
    tok = TextTokenizer(tokenizer=None, chat_template="{{ 'x' * 10**9 }}", bos_token=None,
                        eos_token=None, add_bos=False, stop_ids=frozenset())
    with pytest.raises(TemplateBudgetError, match="repetition"):
        tok.apply_chat_template(MESSAGES)
