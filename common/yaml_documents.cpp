#include "common/yaml_documents.h"

#include <yaml-cpp/eventhandler.h>
#include <yaml-cpp/yaml.h>

#include <optional>
#include <sstream>

namespace pdsim::yaml {

namespace {

int line_of(const YAML::Mark& mark) {
    return mark.is_null() || mark.line < 0 ? 0 : mark.line + 1;
}

// Keeps only where the last document started.
class DocumentStarts : public YAML::EventHandler {
public:
    void OnDocumentStart(const YAML::Mark& mark) override { line = line_of(mark); }
    void OnDocumentEnd() override {}
    void OnNull(const YAML::Mark& /*mark*/, YAML::anchor_t /*anchor*/) override {}
    void OnAlias(const YAML::Mark& /*mark*/, YAML::anchor_t /*anchor*/) override {}
    void OnScalar(const YAML::Mark& /*mark*/, const std::string& /*tag*/, YAML::anchor_t /*anchor*/,
                  const std::string& /*value*/) override {}
    void OnSequenceStart(const YAML::Mark& /*mark*/, const std::string& /*tag*/,
                         YAML::anchor_t /*anchor*/, YAML::EmitterStyle::value /*style*/) override {}
    void OnSequenceEnd() override {}
    void OnMapStart(const YAML::Mark& /*mark*/, const std::string& /*tag*/,
                    YAML::anchor_t /*anchor*/, YAML::EmitterStyle::value /*style*/) override {}
    void OnMapEnd() override {}

    int line = 0;
};

}  // namespace

std::optional<int> second_document_line(const std::string& text) {
    std::istringstream in(text);
    DocumentStarts handler;
    std::optional<YAML::Parser> parser;
    try {
        parser.emplace(in);
        if (!parser->HandleNextDocument(handler)) return std::nullopt;
    } catch (...) {
        return std::nullopt;  // the first document's own error: YAML::Load reports it
    }
    try {
        handler.line = 0;
        if (!parser->HandleNextDocument(handler)) return std::nullopt;
        return handler.line;
    } catch (const YAML::Exception& e) {
        return line_of(e.mark);
    } catch (...) {
        return 0;
    }
}

}  // namespace pdsim::yaml
