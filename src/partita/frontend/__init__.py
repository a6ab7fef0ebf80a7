"""The front door: ``jit``, ``reshard`` and ``mark_sharding``, and the one compile pipeline
(``frontend.pipeline.compile_function``) that they, ``training``, ``virtual`` and ``manual`` all
call: capture -> propagate -> partition with one ``CompileOptions``."""
