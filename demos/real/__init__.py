"""The real-model demo: real code data (the running interpreter's standard library), a held-out function-completion
task and HumanEval. `corpus` finds and splits the modules, `tasks` builds the examples, `metrics` scores completions.
Nothing is imported here so that `import demos.real.corpus` stays light."""
