"""The events contract's checker for the test suite (tests/it/support.rs starts one per test
binary and keeps it running).

Usage: python3 events_checker.py SCHEMA

Loads SCHEMA (docs/events.schema.json), then prints `ready` (or `error: ...` and exits 2 when
the jsonschema package, or the rfc3339-validator that its date-time format check needs, is
missing: scripts/test.sh installs both). Then reads requests, one JSON document per line on
stdin, and answers each with one line on stdout: `ok`, or a JSON array of what is wrong.

  {"body": B}     B (an event body) against the schema's root
  {"entry": E}    E (a stream entry: its field/value pairs, every value a string) against
                  $defs/entry, its `body` field parsed and checked as a body, and its `event`
                  field equal to the body's
  {"schema": null} the schema against the draft 2020-12 meta-schema

Formats are asserted (date-time, uuid), not only annotated. No network: $refs resolve inside
the schema (and the bundled meta-schemas) only.
"""

import json
import sys

try:
    import referencing
    from jsonschema import Draft202012Validator, FormatChecker
except ImportError as e:
    print(f"error: python3 cannot import jsonschema ({e})", flush=True)
    sys.exit(2)

FORMATS = ("date-time", "uuid")


def main():
    with open(sys.argv[1], encoding="utf-8") as f:
        schema = json.load(f)
    checker = FormatChecker()
    missing = [f for f in FORMATS if f not in checker.checkers]
    if missing:
        print(
            f"error: jsonschema cannot check the format(s) {missing}"
            " (date-time needs the rfc3339-validator package)",
            flush=True,
        )
        sys.exit(2)
    # An empty registry (combined with the bundled meta-schemas): no remote $ref is fetched.
    registry = referencing.Registry()

    def validator(s):
        return Draft202012Validator(s, format_checker=checker, registry=registry)

    body_v = validator(schema)
    entry_v = validator(
        {"$schema": schema["$schema"], "$defs": schema["$defs"], "$ref": "#/$defs/entry"}
    )

    def problems(v, doc, where=""):
        return [
            f"{where}{e.message} at /{'/'.join(str(p) for p in e.absolute_path)}"
            for e in sorted(v.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))
        ]

    def entry_problems(fields):
        out = problems(entry_v, fields, "entry: ")
        if isinstance(fields, dict) and isinstance(fields.get("body"), str):
            try:
                body = json.loads(fields["body"])
            except ValueError as e:
                return out + [f"body is not JSON: {e}"]
            out += problems(body_v, body)
            body_event = body.get("event") if isinstance(body, dict) else None
            if fields.get("event") != body_event or not isinstance(body_event, str):
                out.append(
                    f"entry field event {fields.get('event')!r} differs from the body's {body_event!r}"
                )
        return out

    print("ready", flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            if "body" in req:
                out = problems(body_v, req["body"])
            elif "entry" in req:
                out = entry_problems(req["entry"])
            elif "schema" in req:
                out = [
                    f"{e.message} at /{'/'.join(str(p) for p in e.absolute_path)}"
                    for e in Draft202012Validator(
                        Draft202012Validator.META_SCHEMA, registry=registry
                    ).iter_errors(schema)
                ]
            else:
                out = [f"unknown request {sorted(req)}"]
        except Exception as e:  # an answer, never a dead checker
            out = [f"checker error: {type(e).__name__}: {e}"]
        print("ok" if not out else json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
