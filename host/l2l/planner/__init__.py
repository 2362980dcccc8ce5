"""The planner: a relay step's time and memory, predicted before the run.

``shapes.py`` counts a model's layers, ``model.py`` replays the relay's schedule
on the machine's rates (:func:`predict`, :func:`choose_micro_batches`),
``measure.py`` measures those rates here and calibrates them on real relay
steps, ``report.py`` prints the result, ``forecast.py`` is what ``l2l train``
prints beside its measured figures, ``fit.py`` finds the largest model that
fits the machine's memory (``l2l plan --fit``) and ``command.py`` is ``l2l plan``.
"""
from .measure import calibrate, fit_calibration, measure_rates, time_relay_steps
from .model import MicroBatchChoice, Prediction, Rates, choose_micro_batches, predict
from .shapes import LayerShape, gpt_layer_shapes, layer_shapes, meta_layer_shapes

__all__ = ["LayerShape", "MicroBatchChoice", "Prediction", "Rates", "calibrate", "choose_micro_batches",
           "fit_calibration", "gpt_layer_shapes", "layer_shapes", "measure_rates", "meta_layer_shapes",
           "predict", "time_relay_steps"]
