"""The declared modifier API: everything a modifier (built-in or plugin) may import from the engine.

A modifier file imports engine names from here only (``tests/test_modifier_api.py`` fails otherwise, and on
any private name), and uses the session it receives through :class:`ModifierSession` only (the same test
walks every modifier's ``session.…`` uses). The rest of ``recipe_engine`` may change without notice to
modifiers.

* The contract: :class:`Modifier`, :class:`LayerModifier`, :func:`register`, :class:`RecipeError`, and
  :class:`ModifierSession`, the session as a modifier sees it. Its twelve methods: layer surgery
  (``set_layers``; :func:`remove_layers` is built on it), calibration forwards (``capture_inputs``,
  ``run_layer``, ``layer_pass``, ``calibration_nll``), the original model's outputs (``original_outputs``),
  residency (``placed``, ``release``), shared work (``shared``, ``map``) and alternatives side by side
  (``branch``, ``adopt``); its read-only facts (``model``, ``adapter``, ``layers``, ``layer_origin``,
  ``shape``, ``reference``, ``current_layer``, ...) include two small collaborators, ``passes``
  (:class:`PassCounter`) and ``outputs`` (:class:`RunOutputs`: extras, artifacts, quantization records).
  Calibration activations travel as :class:`Activations` (per batch: hidden states, layer keyword arguments,
  token windows; iterate for the stored hidden states, ``on(device)`` for them on a device).
  The symbolic shape :class:`ModelShape` / :class:`LayerShape`, :func:`adapter_for`, the architectures'
  role maps (:data:`ADAPTERS`, :data:`UNFUSED_ROLES`, :func:`roles_problem`, :func:`replace_linear`,
  :func:`install_linear`).
* Statistics: :class:`Statistic`, :class:`InputCovariance` (fp64 input Grams), :func:`position` (dataflow
  order of a submodule), :class:`StagedLayer` (a layer run piecewise).
* Solves (fp64): ridge leverage scores, ridge compensation and refits, reconstruction and refit errors,
  held-out ridge scale, :func:`set_linear_weight`, :func:`submatrix`.
* Pruning method code several steps share: the KV groups to keep (:func:`group_channels`,
  :func:`eq12_group_scores`, :func:`best_groups_by_error`, :func:`greedy_group_elimination`) and a layer's
  ``down_proj`` refitted towards target hidden states (:func:`target_moments`, :func:`refit_down_proj`).
* Transforms: :func:`rotation` (Hadamard / orthogonal), :class:`Grid` (the quantization grid),
  :func:`fold_norm_into` (norm folding), :func:`top_k_kl` (top-k distillation loss).
* Generation: :func:`heldout_failures` (a generation task's last problems, one loss per problem: 1 − passed),
  :func:`heldout_reference` and :func:`heldout_agreement` (a candidate's NLL of the original model's
  completions of them, one forward per problem),
  :func:`check_scoring_task` (the task exists, its rows are installed, the opt-in to execute code).
* Data: :func:`load_text`, :func:`check_text` (a source's pre-flight), :func:`tokenize`; the fit / score split
  of the calibration windows (:func:`heldout_split`, :class:`WindowSplit`).
* Budgets: :data:`LayerBudget` / :func:`budget_field` (a count or a percentage of the model's layers,
  resolved by the engine before a step sees it).
* Steps inside a step (a combinator): :func:`parse_step`, :func:`step_to_dict`, :func:`check_steps` (the
  recipe's validation rules on a shape), :func:`steps_passes`, ``ModifierSession.branch`` / ``adopt`` /
  ``shape``, :class:`SharedWork` (work shared between branches over the same windows).
"""
from .architectures.adapters import (ADAPTERS, FUSED_ROLES, UNFUSED_ROLES, adapter_for, install_linear, replace_linear,
                                     roles_problem)
from .architectures.shape import LayerShape, ModelShape
from .errors import RecipeError
from .evaluation.agreement import heldout_agreement, heldout_reference
from .evaluation.generation import check_scoring_task, heldout_failures
from .execution.activations import Activations, keep as keep_activations, load as load_activations
from .execution.memo import SharedWork
from .execution.modifier_session import CurrentLayer, ModifierSession, PassCounter
from .execution.outputs import RunOutputs
from .execution.session import remove_layers
from .execution.staged import StagedLayer
from .execution.stats import InputCovariance, Statistic, position
from .execution.target_refit import refit_down_proj, target_moments
from .sources.text import check_text, load_text
from .sources.windows import tokenize
from .formats import checkpoint_exporter, checkpoint_formats
from .numerics.hadamard import rotation
from .numerics.head_groups import best_groups_by_error, eq12_group_scores, greedy_group_elimination, group_channels
from .numerics.linalg import (heldout_ridge_scale, lower_triangular_inverse, mean_eigenvalue, obs_kept_columns,
                              reconstruction_error, refit_error, ridge_compensation, ridge_leverage_scores, ridge_refit,
                              set_linear_weight, submatrix)
from .numerics.ops import fold_norm_into, top_k_kl
from .numerics.quantization import Grid
from .plan.steps import steps_passes
from .recipe.budget import LayerBudget, budget_field, byte_count, percentage, percentage_field, share_of
from .recipe.modifier import LayerModifier, Modifier, calibration_nll_bytes, kept_original_sets
from .recipe.registry import register
from .recipe.schema import parse_step, step_to_dict
from .recipe.split import SCORE_FRACTION, WindowSplit, heldout_split
from .recipe.validate import check_steps

__all__ = ["check_scoring_task", "heldout_failures", "heldout_agreement", "heldout_reference", "kept_original_sets",
           "LayerBudget", "budget_field", "byte_count", "percentage", "percentage_field", "share_of", "SharedWork",
           "steps_passes", "parse_step", "step_to_dict", "SCORE_FRACTION", "calibration_nll_bytes", "WindowSplit",
           "heldout_split", "check_steps", "ADAPTERS", "FUSED_ROLES", "UNFUSED_ROLES", "install_linear",
           "replace_linear", "roles_problem", "Grid", "checkpoint_exporter", "checkpoint_formats", "InputCovariance",
           "LayerModifier",
           "LayerShape", "ModelShape", "Modifier", "RecipeError", "ModifierSession", "Activations", "keep_activations",
           "load_activations", "CurrentLayer", "PassCounter", "RunOutputs", "remove_layers", "StagedLayer",
           "Statistic", "adapter_for", "fold_norm_into", "heldout_ridge_scale",
           "check_text", "load_text", "lower_triangular_inverse", "mean_eigenvalue", "obs_kept_columns", "position",
           "reconstruction_error",
           "refit_error", "register",
           "ridge_compensation", "ridge_leverage_scores", "ridge_refit", "rotation", "set_linear_weight",
           "submatrix", "tokenize", "top_k_kl", "best_groups_by_error", "eq12_group_scores",
           "greedy_group_elimination", "group_channels", "refit_down_proj", "target_moments"]
