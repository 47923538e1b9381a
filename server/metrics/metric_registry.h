// The prometheus-cpp registry of the family table (metric_families.h): every family registered from its row, and the
// series that exist from the start made at once and looked up by label value.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "server/metrics/metric_families.h"

namespace prometheus {
class Registry;
class Counter;
class Gauge;
class Histogram;
template <typename T>
class Family;
}  // namespace prometheus

namespace skyreels::server {

using MetricLabels = std::map<std::string, std::string>;

class MetricRegistry {
 public:
  // `replicas`: the label values of the Series::Replicas families.
  explicit MetricRegistry(const std::vector<std::string>& replicas);
  ~MetricRegistry();
  MetricRegistry(const MetricRegistry&) = delete;
  MetricRegistry& operator=(const MetricRegistry&) = delete;

  std::string render() const;  // the Prometheus text exposition

  // A series made at start: a Series::Single family's one (value empty), or the one of `value` (a Series::Values
  // value or a replica). nullptr when there is none such: an unknown value is not counted.
  prometheus::Counter* counter(MetricId id, std::string_view value = {}) const;
  prometheus::Gauge* gauge(MetricId id, std::string_view value = {}) const;
  prometheus::Histogram* histogram(MetricId id, std::string_view value = {}) const;

  // A series of a Series::OnDemand family, made on first use; the caller bounds the label values.
  prometheus::Counter& add_counter(MetricId id, const MetricLabels& labels);
  prometheus::Gauge& add_gauge(MetricId id, const MetricLabels& labels);
  prometheus::Histogram& add_histogram(MetricId id, const MetricLabels& labels);

 private:
  template <typename M>
  struct Bound {
    prometheus::Family<M>* family = nullptr;
    std::map<std::string, M*, std::less<>> series;  // by the one label's value ("" for Series::Single)
  };
  using Row = std::tuple<Bound<prometheus::Counter>, Bound<prometheus::Gauge>, Bound<prometheus::Histogram>>;

  template <typename M>
  void register_row(const MetricFamily& family, const std::vector<std::string>& replicas);
  template <typename M>
  M* series(MetricId id, std::string_view value) const;
  template <typename M>
  M& add(MetricId id, const MetricLabels& labels);

  std::shared_ptr<prometheus::Registry> registry_;
  std::vector<Row> rows_;  // by MetricId
};

}  // namespace skyreels::server
