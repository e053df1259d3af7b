//! A gauge read from its source on each scrape, for values another component keeps (such as
//! the Redis gateway's tarpitted connections), when that component exists only after the
//! metrics registry was built.

use std::fmt;
use std::sync::{Arc, OnceLock};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::gauge::ConstGauge;

type Source = Box<dyn Fn() -> i64 + Send + Sync>;

/// The handle: set the source once; until then (or without one) the gauge reads 0.
#[derive(Clone, Default)]
pub struct SampledGauge {
    source: Arc<OnceLock<Source>>,
}

impl SampledGauge {
    /// Where the value comes from from now on; a second source is ignored.
    pub fn set_source(&self, source: impl Fn() -> i64 + Send + Sync + 'static) {
        let _ = self.source.set(Box::new(source));
    }

    fn value(&self) -> i64 {
        self.source.get().map_or(0, |f| f())
    }

    /// The collector to register, under `name` with `help`.
    pub fn collector(&self, name: &'static str, help: &'static str) -> Box<dyn Collector> {
        Box::new(SampledCollector {
            gauge: self.clone(),
            name,
            help,
        })
    }
}

struct SampledCollector {
    gauge: SampledGauge,
    name: &'static str,
    help: &'static str,
}

impl fmt::Debug for SampledCollector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SampledCollector")
            .field("name", &self.name)
            .finish()
    }
}

impl Collector for SampledCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), fmt::Error> {
        let gauge = ConstGauge::new(self.gauge.value());
        let metric = encoder.encode_descriptor(self.name, self.help, None, gauge.metric_type())?;
        gauge.encode(metric)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::registry::Registry;

    #[test]
    fn reads_zero_until_a_source_is_set_then_the_source() {
        let gauge = SampledGauge::default();
        let mut registry = Registry::with_prefix("fencegate");
        registry.register_collector(gauge.collector("things_now", "Things now"));
        let render = |r: &Registry| {
            let mut text = String::new();
            prometheus_client::encoding::text::encode(&mut text, r).unwrap();
            text
        };
        assert!(render(&registry).contains("fencegate_things_now 0"));
        gauge.set_source(|| 7);
        assert!(render(&registry).contains("fencegate_things_now 7"));
    }
}
