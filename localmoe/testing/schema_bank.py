"""A bank of JSON schemas and tools for structured-output tests and benchmarks.

Each entry of :data:`SCHEMAS` is ``(name, prompt, schema)``: a chat prompt that asks for data
the schema describes. Together they cover nested objects, arrays (bounded, of objects, of
enums), enums, ``anyOf``, integer and number bounds, required and optional properties, string
patterns and lengths, ``$ref`` / ``$defs`` and ``const``. Every string and array is bounded so
a valid answer fits in :data:`MAX_TOKENS` tokens. :data:`TOOLS` are OpenAI tool definitions
with parameter schemas of the same kinds; :data:`TOOL_PROMPTS` ask for them.

Used by ``tests/serve/test_structured.py`` (a few requests per schema) and
``benchmarks/bench_structured.py`` (100 per schema, validity rate recorded).
"""

from __future__ import annotations

MAX_TOKENS = 200

SCHEMAS: list[tuple[str, str, dict]] = [
    ("person_nested", "Describe a fictional person as JSON with their name, age and address.",
     {"type": "object", "properties": {
         "name": {"type": "string", "minLength": 1, "maxLength": 40},
         "age": {"type": "integer", "minimum": 0, "maximum": 120},
         "address": {"type": "object", "properties": {
             "street": {"type": "string", "maxLength": 60},
             "city": {"type": "string", "minLength": 1, "maxLength": 40},
             "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
             "required": ["city", "zip"]}},
      "required": ["name", "age", "address"]}),
    ("shopping_array", "Write a shopping list of up to five items as JSON.",
     {"type": "object", "properties": {
         "items": {"type": "array", "minItems": 1, "maxItems": 5, "items": {
             "type": "object", "properties": {
                 "item": {"type": "string", "minLength": 1, "maxLength": 30},
                 "quantity": {"type": "integer", "minimum": 1, "maximum": 99}},
             "required": ["item", "quantity"]}}},
      "required": ["items"]}),
    ("sentiment_enum", "Classify the sentiment of: 'I loved the film, the ending was great.'",
     {"type": "object", "properties": {
         "sentiment": {"enum": ["positive", "negative", "neutral"]},
         "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
      "required": ["sentiment", "confidence"]}),
    ("contact_anyof", "Give one way to contact a support team, as JSON.",
     {"type": "object", "properties": {
         "contact": {"anyOf": [
             {"type": "object", "properties": {
                 "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.(com|org)$"}},
              "required": ["email"]},
             {"type": "object", "properties": {
                 "phone": {"type": "string", "pattern": "^\\+?[0-9]{7,12}$"}},
              "required": ["phone"]}]}},
      "required": ["contact"]}),
    ("reading_bounds", "Report a weather station reading as JSON.",
     {"type": "object", "properties": {
         "temperature_c": {"type": "number", "minimum": -60, "maximum": 60},
         "humidity_pct": {"type": "integer", "minimum": 0, "maximum": 100},
         "wind_kmh": {"type": "number", "exclusiveMinimum": 0, "maximum": 250}},
      "required": ["temperature_c", "humidity_pct", "wind_kmh"]}),
    ("book_optional", "Describe a book as JSON: title, and optionally the year and a rating.",
     {"type": "object", "properties": {
         "title": {"type": "string", "minLength": 1, "maxLength": 60},
         "year": {"type": "integer", "minimum": 1450, "maximum": 2030},
         "rating": {"type": "integer", "minimum": 1, "maximum": 5},
         "tags": {"type": "array", "items": {"type": "string", "maxLength": 15}, "maxItems": 3}},
      "required": ["title"]}),
    ("ids_pattern", "Create a product record as JSON with an SKU like AB-1234 and a date.",
     {"type": "object", "properties": {
         "sku": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4}$"},
         "date": {"type": "string", "pattern": "^20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]$"},
         "color": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}},
      "required": ["sku", "date", "color"]}),
    ("graph_refs", "Describe a small team as JSON: a lead and up to three members.",
     {"$defs": {"member": {"type": "object", "properties": {
         "name": {"type": "string", "minLength": 1, "maxLength": 30},
         "role": {"enum": ["dev", "design", "ops"]}}, "required": ["name", "role"]}},
      "type": "object", "properties": {
          "kind": {"const": "team"},
          "lead": {"$ref": "#/$defs/member"},
          "members": {"type": "array", "items": {"$ref": "#/$defs/member"}, "maxItems": 3}},
      "required": ["kind", "lead", "members"]}),
]

TOOLS: list[dict] = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather for a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "minLength": 1, "maxLength": 40},
            "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two numbers.",
        "parameters": {"type": "object", "properties": {
            "a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}},
    {"type": "function", "function": {
        "name": "multiply", "description": "Multiply two numbers.",
        "parameters": {"type": "object", "properties": {
            "a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}},
    {"type": "function", "function": {
        "name": "send_email", "description": "Send an email.",
        "parameters": {"type": "object", "properties": {
            "to": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.com$"},
            "subject": {"type": "string", "maxLength": 40},
            "urgent": {"type": "boolean"}},
            "required": ["to", "subject"]}}},
]

TOOL_PROMPTS: list[str] = [
    "What's the weather like in Lisbon?",
    "What is 17 plus 25?",
    "Multiply 6 by 7 for me.",
    "Email bob@example.com that the meeting moved to 3pm.",
    "Is it raining in Tokyo right now, in fahrenheit?",
]


def tool_schema(name: str) -> dict:
    """The parameters schema of the tool called ``name``.

    Raises:
        KeyError: no such tool.
    """
    for t in TOOLS:
        if t["function"]["name"] == name:
            return t["function"]["parameters"]
    raise KeyError(name)
