// The generation parameters on the wire: skyreels.v1.GenerationParams <-> JobRequest / ResolvedParams, driven by
// the table of server/generation_params.h through protobuf reflection (each row's name is its field's path), so a
// parameter added to the table and the proto travels without code here. Wire format and field numbers are the
// proto's. No gRPC.
#pragma once

#include "server/job/generation_params.h"
#include "skyreels/v1/video_service.pb.h"

namespace google::protobuf {
class FieldDescriptor;
}

namespace skyreels::server {

// The field a table row maps to; throws std::logic_error when the proto has none of the row's path and kind.
const google::protobuf::FieldDescriptor& proto_field(const GenerationParam& param);

// The fields the message sets, into the request (unset fields stay unset).
void request_params_from_proto(const v1::GenerationParams& proto, JobRequest& request);
// The parameters the request sets, into the message (a client sending a request).
void request_params_to_proto(const JobRequest& request, v1::GenerationParams* proto);
// Every parameter in effect (Job.params); unset only where the value is (overlap_history of a short video).
void resolved_params_to_proto(const ResolvedParams& params, v1::GenerationParams* proto);

}  // namespace skyreels::server
