"""SPARe theory, Monte-Carlo, time-to-train simulation (fast loop and SimGrid) and cluster planning.

Modules: :mod:`.theory` (closed forms), :mod:`.checkpoint_period` (Saxena/Young periods, availability),
:mod:`.montecarlo` (failure trails through the real ReCtlr), :mod:`.failures` (failure trails shared by
every scheme), :mod:`.collective` (alpha-beta all-reduce and checkpoint cost), :mod:`.timetotrain`
(discrete-event loop, paired comparison), :mod:`.stats` (intervals over trails), :mod:`.simgrid_model`
(all-reduce and checkpoint traffic on a SimGrid 3.32 platform), :mod:`.planning` (``plan cluster``) and
:mod:`.plan_file` (the chosen plan as TOML: ``write_plan`` / ``read_plan``).
"""
