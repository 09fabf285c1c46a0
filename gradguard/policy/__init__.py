"""What a policy says and which parameters it covers.

- ``schema``: the actions, rules and step windows (pydantic, frozen);
- ``document``: [`Policy`][gradguard.Policy], a validated document, from a file or a dict;
- ``loading``: YAML/TOML/JSON files, and every problem as a [`PolicyError`][gradguard.PolicyError] with file and line;
- ``limits``: the caps a file or dict cannot blow through (size, depth, YAML aliases, rules, patterns);
- ``patterns``: globs and ``re:`` patterns (RE2), each matched in time linear in the parameter name;
- ``matching``: binding a policy to a model's parameters (the only module here that imports torch);
- ``json_schema``: the policy's JSON Schema for editors (``gradguard schema``);
- ``shipped``: the policies gradguard ships, read from the installed package (``Policy.shipped``).
"""
