// What the webhook sender reports, declared where it reports it (Metrics implements it), so that webhook/ never
// includes the metrics registry above it.
#pragma once

#include <string>

namespace skyreels::server {

class WebhookMetrics {
 public:
  virtual ~WebhookMetrics() = default;
  // One delivery attempt ended: outcome delivered, failed (a retry follows) or abandoned.
  virtual void webhook_attempted(const std::string& outcome) = 0;
};

}  // namespace skyreels::server
