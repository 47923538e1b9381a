#include "server/metrics/metric_registry.h"

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include <stdexcept>

namespace skyreels::server {

namespace {

template <typename M>
prometheus::Family<M>& build_family(const MetricFamily& row, prometheus::Registry& registry);

template <>
prometheus::Family<prometheus::Counter>& build_family(const MetricFamily& row, prometheus::Registry& registry) {
  return prometheus::BuildCounter().Name(row.name).Help(row.help).Register(registry);
}

template <>
prometheus::Family<prometheus::Gauge>& build_family(const MetricFamily& row, prometheus::Registry& registry) {
  return prometheus::BuildGauge().Name(row.name).Help(row.help).Register(registry);
}

template <>
prometheus::Family<prometheus::Histogram>& build_family(const MetricFamily& row, prometheus::Registry& registry) {
  return prometheus::BuildHistogram().Name(row.name).Help(row.help).Register(registry);
}

// Histograms take the row's buckets; counters and gauges take nothing more.
template <typename M>
M& add_series(prometheus::Family<M>& family, const MetricFamily&, const MetricLabels& labels) {
  return family.Add(labels);
}

template <>
prometheus::Histogram& add_series(prometheus::Family<prometheus::Histogram>& family, const MetricFamily& row,
                                  const MetricLabels& labels) {
  return family.Add(labels, prometheus::Histogram::BucketBoundaries(row.buckets));
}

// The label values of the series made at start ("" is the unlabelled one).
std::vector<std::string> preset_values(const MetricFamily& row, const std::vector<std::string>& replicas) {
  switch (row.series) {
    case Series::Single:
      return {""};
    case Series::Values:
      return row.values;
    case Series::Replicas:
      return replicas;
    case Series::OnDemand:
      break;
  }
  return {};
}

}  // namespace

MetricRegistry::MetricRegistry(const std::vector<std::string>& replicas)
    : registry_(std::make_shared<prometheus::Registry>()), rows_(metric_families().size()) {
  for (const MetricFamily& row : metric_families()) {
    switch (row.type) {
      case MetricType::Counter:
        register_row<prometheus::Counter>(row, replicas);
        break;
      case MetricType::Gauge:
        register_row<prometheus::Gauge>(row, replicas);
        break;
      case MetricType::Histogram:
        register_row<prometheus::Histogram>(row, replicas);
        break;
    }
  }
}

MetricRegistry::~MetricRegistry() = default;

template <typename M>
void MetricRegistry::register_row(const MetricFamily& row, const std::vector<std::string>& replicas) {
  Bound<M>& bound = std::get<Bound<M>>(rows_[static_cast<size_t>(row.id)]);
  bound.family = &build_family<M>(row, *registry_);
  for (const std::string& value : preset_values(row, replicas)) {
    const MetricLabels labels = value.empty() ? MetricLabels{} : MetricLabels{{row.labels.at(0), value}};
    bound.series[value] = &add_series(*bound.family, row, labels);
  }
}

std::string MetricRegistry::render() const {
  prometheus::TextSerializer serializer;
  return serializer.Serialize(registry_->Collect());
}

template <typename M>
M* MetricRegistry::series(MetricId id, std::string_view value) const {
  const Bound<M>& bound = std::get<Bound<M>>(rows_.at(static_cast<size_t>(id)));
  const auto it = bound.series.find(value);
  return it == bound.series.end() ? nullptr : it->second;
}

template <typename M>
M& MetricRegistry::add(MetricId id, const MetricLabels& labels) {
  const MetricFamily& row = metric_family(id);
  if (row.series != Series::OnDemand) throw std::logic_error(std::string(row.name) + " has no series on demand");
  prometheus::Family<M>* family = std::get<Bound<M>>(rows_.at(static_cast<size_t>(id))).family;
  if (family == nullptr) throw std::logic_error(std::string(row.name) + " is a " + metric_type_name(row.type));
  return add_series(*family, row, labels);
}

prometheus::Counter* MetricRegistry::counter(MetricId id, std::string_view value) const {
  return series<prometheus::Counter>(id, value);
}

prometheus::Gauge* MetricRegistry::gauge(MetricId id, std::string_view value) const {
  return series<prometheus::Gauge>(id, value);
}

prometheus::Histogram* MetricRegistry::histogram(MetricId id, std::string_view value) const {
  return series<prometheus::Histogram>(id, value);
}

prometheus::Counter& MetricRegistry::add_counter(MetricId id, const MetricLabels& labels) {
  return add<prometheus::Counter>(id, labels);
}

prometheus::Gauge& MetricRegistry::add_gauge(MetricId id, const MetricLabels& labels) {
  return add<prometheus::Gauge>(id, labels);
}

prometheus::Histogram& MetricRegistry::add_histogram(MetricId id, const MetricLabels& labels) {
  return add<prometheus::Histogram>(id, labels);
}

}  // namespace skyreels::server
