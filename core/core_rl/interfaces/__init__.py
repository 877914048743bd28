"""The contracts of the components plugins provide, one module per family: the engines
(:mod:`.engines`), the algorithm components (:mod:`.algorithms`), rewards (:mod:`.rewards`),
loggers and what they receive (:mod:`.loggers`), sampling parameters (:mod:`.sampling`), training
loops (:mod:`.loops`), model sources (:mod:`.model_sources`). The rollout-side contracts
(environments, workflows, tool parsers) live with the rollout (:mod:`core_rl.rollout`) and the
launcher's with the launch (:mod:`core_rl.launch`); every one is importable from here. Factories
are registered through :mod:`core_rl.hookspecs`; what they return must satisfy these classes (the
conformance kit in :mod:`core_rl.testing` checks it)."""

from core_rl.interfaces.algorithms import AdvantageEstimator as AdvantageEstimator
from core_rl.interfaces.algorithms import AlgorithmRecipe as AlgorithmRecipe
from core_rl.interfaces.algorithms import ImportanceCorrection as ImportanceCorrection
from core_rl.interfaces.algorithms import PolicyLoss as PolicyLoss
from core_rl.interfaces.algorithms import RejectionSampler as RejectionSampler
from core_rl.interfaces.algorithms import SampleFilter as SampleFilter
from core_rl.interfaces.engines import HEADS as HEADS
from core_rl.interfaces.engines import LOGPROBS_AT as LOGPROBS_AT
from core_rl.interfaces.engines import MEMORY_PARTS as MEMORY_PARTS
from core_rl.interfaces.engines import PAUSE_MODES as PAUSE_MODES
from core_rl.interfaces.engines import VALUE_HEADS as VALUE_HEADS
from core_rl.interfaces.engines import WEIGHT_SYNC_MODES as WEIGHT_SYNC_MODES
from core_rl.interfaces.engines import LossFn as LossFn
from core_rl.interfaces.engines import LossOutput as LossOutput
from core_rl.interfaces.engines import RolloutEngine as RolloutEngine
from core_rl.interfaces.engines import TrainEngine as TrainEngine
from core_rl.interfaces.engines import ValueLossFn as ValueLossFn
from core_rl.interfaces.loggers import Logger as Logger
from core_rl.interfaces.loggers import RunInfo as RunInfo
from core_rl.interfaces.loggers import SampleRecord as SampleRecord
from core_rl.interfaces.loggers import sample_table as sample_table
from core_rl.interfaces.loops import TrainingLoop as TrainingLoop
from core_rl.interfaces.model_sources import ModelSource as ModelSource
from core_rl.interfaces.rewards import Reward as Reward
from core_rl.interfaces.rewards import RewardScores as RewardScores
from core_rl.interfaces.sampling import SamplingParams as SamplingParams
from core_rl.interfaces.sampling import batch_key as batch_key
from core_rl.interfaces.sampling import with_extra as with_extra
from core_rl.interfaces.servers import ServerEnvError as ServerEnvError
from core_rl.interfaces.servers import ServerEnvSpec as ServerEnvSpec
from core_rl.plugins.lazy_exports import lazy_exports

_lazy_all, __getattr__ = lazy_exports(
    __name__,
    {
        "core_rl.rollout.environments": ("Action", "Environment", "StepResult"),
        "core_rl.rollout.workflows": ("RolloutWorkflow", "WorkflowContext"),
        "core_rl.rollout.tool_parsers": ("ToolCall", "ToolParser"),
        "core_rl.launch.launchers": ("LaunchRequest", "Launcher"),
        "core_rl.data.sources": ("DataSource",),
    },
)
__all__ = sorted(
    [
        *[
            "LossOutput",
            "LossFn",
            "ValueLossFn",
            "LOGPROBS_AT",
            "HEADS",
            "VALUE_HEADS",
            "TrainEngine",
            "WEIGHT_SYNC_MODES",
            "PAUSE_MODES",
            "MEMORY_PARTS",
            "RolloutEngine",
            "AdvantageEstimator",
            "PolicyLoss",
            "ImportanceCorrection",
            "RejectionSampler",
            "SampleFilter",
            "AlgorithmRecipe",
            "TrainingLoop",
            "ModelSource",
            "RunInfo",
            "SampleRecord",
            "sample_table",
            "Logger",
            "RewardScores",
            "Reward",
            "SamplingParams",
            "batch_key",
            "with_extra",
            "ServerEnvError",
            "ServerEnvSpec",
        ],
        *_lazy_all,
    ]
)
