# Chat templates: a Jinja interpreter for Hugging Face chat templates and the tokenizer-config
# loader on top of it (docs/chat_templates.md). Included from src/CMakeLists.txt.
target_sources(lathe PRIVATE
  data/jinja_lexer.cpp
  data/jinja_parser.cpp
  data/jinja_value.cpp
  data/jinja_strings.cpp
  data/jinja_builtins.cpp
  data/jinja_eval.cpp
  data/chat_template.cpp
)
