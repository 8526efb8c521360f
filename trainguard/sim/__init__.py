"""SPARe theory, Monte-Carlo, time-to-train simulation (fast loop and SimGrid) and checkpoint planning.

Modules: :mod:`.theory` (closed forms), :mod:`.checkpoint_period` (Saxena/Young periods, availability),
:mod:`.montecarlo` (failure trails through the real ReCtlr), :mod:`.timetotrain` (discrete-event loop),
:mod:`.simgrid_model` (the same model on SimGrid 3.32).
"""
