//! Named fault points: crash the worker at an exact moment, to prove that no moment loses or
//! duplicates an effect. Only with the `fault-injection` feature (the chaos suite and the
//! tests enable it), and off unless a [`FaultInjector`] is configured; without the feature
//! the points compile to nothing.

pub(crate) mod point;

#[cfg(feature = "fault-injection")]
pub use point::FaultPoint;

#[cfg(feature = "fault-injection")]
mod inject;
#[cfg(feature = "fault-injection")]
pub(crate) use inject::Settled;
#[cfg(feature = "fault-injection")]
pub use inject::{
    CrashAlways, CrashOnce, FaultAction, FaultInjector, RandomFaults, FAULTS_ENV, FAULT_SEED_ENV,
};
